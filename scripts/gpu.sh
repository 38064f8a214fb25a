#!/usr/bin/env bash
# vexact-vllm on an NVIDIA GPU, from a clone installed with `pip install -e ".[gpu,dev]"`:
#
#   bash scripts/gpu.sh tests [PYTEST ARGS]   the CUDA tests (pytest -m cuda: kernels, sampler graphs, TP rules)
#   bash scripts/gpu.sh check [MODEL ...]     vexact-vllm check --against-stock on each built-in model (default:
#                                             tiny-qwen3 tiny-qwen2 tiny-llama tiny-qwen3-moe qwen3-1.7b-shape),
#                                             then on qwen3-1.7b-shape with four 2,700-3,300-token prompts (past
#                                             the attention's 2,048-key split), and at tensor-parallel size 2 on
#                                             tiny-llama and tiny-qwen3-moe when there are two GPUs
#   bash scripts/gpu.sh bench [BENCH ARGS]    vexact-vllm bench on the Qwen3-1.7B shape (dummy weights): stock vLLM,
#                                             stock batch-invariant and vexact, workloads default and grpo:32, side
#                                             by side on the GPU; BENCH ARGS override (e.g. --model qwen3-8b-shape)
#   bash scripts/gpu.sh all                   tests, check, bench
#
# PYTHON picks the interpreter (default python3). With OUT=DIR each step's output is also kept in
# DIR/STEP.log. Exits non-zero when any step fails; the last lines name each step's result.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
failed=()
results=()

run() {  # run NAME CMD...: the command, its output also in $OUT/NAME.log when OUT is set
  local name=$1 rc
  shift
  echo "== $name: $*"
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    "$@" 2>&1 | tee -a "$OUT/$name.log"
  else
    "$@"
  fi
  rc=$?
  results+=("$name: $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)")")
  [ $rc = 0 ] || failed+=("$name")
}

long_prompts() {  # long_prompts FILE: four prompts of 2,700-3,300 tokens of the built-in tokenizer
  "$py" - "$1" <<'PY'
import random, sys
rng = random.Random(5)
words = ("the of and to in is was for on that with as by at from his her an which were are this be had not have or "
         "their one all its also new first two has been other after more into time who some would can only most").split()
with open(sys.argv[1], "w") as f:
    for n in (900, 950, 1000, 1100):
        f.write(" ".join(rng.choice(words) + (str(rng.randrange(100)) if rng.random() < 0.2 else "") for _ in range(n)) + "\n")
PY
}

tests() {
  run tests "$py" -m pytest -q -m cuda tests "$@"
}

check() {
  local models=("$@") model prompts
  [ ${#models[@]} -gt 0 ] || models=(tiny-qwen3 tiny-qwen2 tiny-llama tiny-qwen3-moe qwen3-1.7b-shape)
  for model in "${models[@]}"; do
    run "check-$model" "$py" -m vexact_vllm.cli check --model "$model" --against-stock --quiet
  done
  prompts=$(mktemp --suffix=.txt)
  long_prompts "$prompts"
  run check-long "$py" -m vexact_vllm.cli check --model qwen3-1.7b-shape --prompts "$prompts" --num-prompts 4 \
    --max-tokens 48 --max-model-len 4096 --quiet
  rm -f "$prompts"
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    for model in tiny-llama tiny-qwen3-moe; do
      run "check-tp2-$model" "$py" -m vexact_vllm.cli check --model "$model" --tensor-parallel-size 2 --quiet
    done
  fi
}

bench() {
  run bench "$py" -m vexact_vllm.cli bench --model qwen3-1.7b-shape --workload default,grpo:32 --interleave "$@"
}

case "${1:-}" in
  tests|check|bench) step=$1; shift; "$step" "$@" ;;
  all) tests; check; bench ;;
  *) sed -n '2,16p' "$0" | cut -c3-; exit 2 ;;
esac
printf '%s\n' "${results[@]}"
[ ${#failed[@]} = 0 ]
