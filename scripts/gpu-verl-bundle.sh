#!/usr/bin/env bash
# Builds verl 0.9.1's stack (Ray, Hydra, tensordict, datasets, ...) and VeOmni 0.1.12 for the offline
# GPU host (Python 3.12; torch, transformers, pandas, pyarrow... already there; vLLM brought by
# ../shared/gpu/vllm-bundle.sh) as one part of under 40 MiB: .gpu/v1. Run it in the project root,
# where PyPI is reachable. On the host, after vLLM's three parts: carry .gpu/v1 and run
#   bash .gpu/v1/stage-verl.sh && source /opt/vx/env.sh && bash examples/verl/smoke_1gpu.sh
# Ray's wheel (79 MB) loses its Java jars and RLlib and is re-zipped uncompressed, then xz'd (23 MB).
set -euo pipefail
root=$(pwd)
cache=$root/.gpu/vcache
out=$root/.gpu/v1
py=${PYTHON:-python3}
image=${IMAGE_PACKAGES:-$root/../shared/gpu/gpu-image-packages.txt}
mkdir -p "$cache/dl"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu/' >> .git/info/exclude; }
plat=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux1; do plat+=(--platform "${p}_x86_64"); done
dl=("$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}")

if [ ! -f "$cache/.done" ]; then
  # The versions the CPU tests use, plus TransferQueue (verl's default v1 trainer imports it). hydra-core
  # and omegaconf are pinned, or pip backtracks to 2019 releases: antlr4-python3-runtime is source-only
  # (built here as a wheel, with pylatexenc, the other one).
  "${dl[@]}" -d "$cache/dl" 'ray[default]==2.60.0' codetiming==1.4.0 'tensordict==0.10.0' torchdata==0.11.0 \
      datasets==5.2.0 dill==0.4.1 'numpy<2.4'
  "${dl[@]}" --no-deps -d "$cache/dl" hydra-core==1.3.8 omegaconf==2.3.1 verl==0.9.1 veomni==0.1.12 \
      blobfile==3.3.0 pycryptodomex TransferQueue==0.1.11
  "$py" -m pip wheel -q --no-deps -w "$cache/dl" antlr4-python3-runtime==4.9.3 pylatexenc==2.11
  touch "$cache/.done"
fi

rm -rf "$out" && mkdir -p "$out"
have=$(mktemp)
trap 'rm -f "$have"' EXIT
cat "$image" > "$have"
ls "$root"/.gpu/p1/*.whl 2>/dev/null | xargs -rn1 basename | sed -E 's/-[0-9].*//' | tr '_A-Z' '-a-z' >> "$have"
for f in "$cache"/dl/*.whl; do
  n=$(basename "$f" | sed -E 's/-[0-9].*//' | tr '_A-Z' '-a-z')
  case "$n" in nvidia-*|torch|triton|cuda-*) continue;; esac
  grep -qx "$n" "$have" && continue
  cp "$f" "$out/"
done

ray=$(ls "$out"/ray-*.whl)
"$py" - "$ray" <<'PY'
import sys, zipfile
src = sys.argv[1]
tmp = src + ".stored"
drop = lambda f: f.startswith(("ray/jars/", "ray/rllib/")) or f.endswith(".js.map")
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zo:
    for info in zi.infolist():
        if drop(info.filename):
            continue
        data = zi.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(l for l in data.decode().splitlines(True) if not drop(l.split(",")[0])).encode()
        zo.writestr(info, data, compress_type=zipfile.ZIP_STORED)
PY
mv "$ray.stored" "$ray" && xz -T0 -9 "$ray"

cat > "$out/stage-verl.sh" <<'STAGE'
#!/usr/bin/env bash
# On the GPU host, after vLLM's stage.sh: installs the carried wheels into /opt/vx/verl (on PYTHONPATH
# through /opt/vx/env.sh) and this project in editable mode. Safe to run again.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ -f /opt/vx/env.sh ] || { echo "vLLM is not staged yet (run ../shared/gpu's three parts first)" >&2; exit 1; }
if [ ! -f /opt/vx/verl.done ]; then
  tmp=$(mktemp -d)
  cp "$here"/*.whl "$tmp"/
  for x in "$here"/*.whl.xz; do xz -dc "$x" > "$tmp/$(basename "${x%.xz}")"; done
  # A target of its own: pip --target skips (or, with --upgrade, replaces) top-level directories that
  # exist already, and vLLM's dependencies in /opt/vx/site share some (google/).
  python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/vx/verl "$tmp"/*.whl
  rm -rf "$tmp"
  printf 'export PYTHONPATH=$PYTHONPATH:/opt/vx/verl\nexport PATH=$PATH:/opt/vx/verl/bin\n' >> /opt/vx/env.sh
  touch /opt/vx/verl.done
fi
python3 -m pip install -q --no-deps --no-build-isolation -e .
echo "verl staged: source /opt/vx/env.sh"
STAGE
chmod +x "$out/stage-verl.sh"
du -sh "$out"
