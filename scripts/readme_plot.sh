#!/usr/bin/env bash
# The README's picture, docs/images/check.png: the default check on the built-in tiny Qwen3 (random
# weights, CPU) with stock vLLM beside it, drawn by `vexact-vllm check --plot` (vexact's differences
# from the trainer, all exactly 0, beside stock's). Needs matplotlib: pip install -e ".[plot]".
#   bash scripts/readme_plot.sh          # about 2 minutes on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
mkdir -p docs/images
"$VENV/bin/vexact-vllm" check --against-stock --plot docs/images/check.png "$@"
