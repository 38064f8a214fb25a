#!/usr/bin/env bash
# The gpu extra's CuTe-DSL GEMMs (quack-kernels, nvidia-cutlass-dsl for CUDA 13: kernels/gemm/linear_cute.py)
# for a GPU host without network, in two parts of under 60 MiB (the CUDA 13 library wheel, 92 MB, is split
# across them). Here, in the project root:
#
#   bash scripts/gpu-quack.sh            writes .gpu/q1 and .gpu/q2 (wheels for CPython 3.12, x86-64)
#
# Then on the host, back to back (a host is given back shortly after a call):
#   with .gpu/q1 carried: bash .gpu/q1/stage-quack.sh
#   with .gpu/q2 carried: bash .gpu/q2/stage-quack.sh     (installs into the host's python3)
#
# Without these, the CUDA tests of the CuTe-DSL path fail (it is part of the gpu extra) and every GEMM takes
# the Triton kernel, with the same bits.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=$(grep -o '"quack-kernels==[^"]*"\|"nvidia-cutlass-dsl\[cu13\]==[^"]*"' pyproject.toml | tr -d '"')
dsl=$(echo "$pins" | grep -o 'nvidia-cutlass-dsl\[cu13\]==.*' | cut -d= -f3)
[ -n "$dsl" ] || { echo "pyproject.toml's gpu extra pins no nvidia-cutlass-dsl[cu13]" >&2; exit 1; }
cache=.gpu/quack-cache
mkdir -p "$cache" .gpu/q1 .gpu/q2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$cache" $(echo "$pins" | sed 's/\[cu13\]//') "nvidia-cutlass-dsl-libs-base==$dsl" \
  "nvidia-cutlass-dsl-libs-core==$dsl" "nvidia-cutlass-dsl-libs-cu13==$dsl" "apache-tvm-ffi<0.2,>=0.1.11" \
  torch-c-dlpack-ext
big=$(ls "$cache"/nvidia_cutlass_dsl_libs_cu13-*.whl)
rm -f .gpu/q1/* .gpu/q2/*
find "$cache" -name '*.whl' ! -name "$(basename "$big")" -exec cp {} .gpu/q1/ \;
split -n 2 "$big" ".gpu/q1/$(basename "$big").part-"
mv ".gpu/q1/$(basename "$big").part-ab" .gpu/q2/
for part in q1 q2; do
  cat > ".gpu/$part/stage-quack.sh" <<'STAGE'
#!/usr/bin/env bash
# On the GPU host: collect this part under /opt/vxq; with both there, join the split wheel and install.
set -euo pipefail
mkdir -p /opt/vxq
cp "$(dirname "$0")"/*.whl* /opt/vxq/
ls /opt/vxq/*.part-ab >/dev/null 2>&1 || { echo "quack: first part staged"; exit 0; }
for first in /opt/vxq/*.part-aa; do cat "$first" "${first%aa}ab" > "${first%.part-aa}"; rm "$first" "${first%aa}ab"; done
python3 -m pip install -q --no-index --no-deps --no-compile /opt/vxq/*.whl
python3 -c "import quack.gemm_interface, cutlass" && echo "quack installed"
STAGE
done
du -sh .gpu/q1 .gpu/q2
