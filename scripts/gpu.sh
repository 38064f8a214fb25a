#!/usr/bin/env bash
# vexact-vllm on an NVIDIA GPU, from a clone installed with `pip install -e ".[gpu,dev]"` (on a host without
# network, the gpu extra's CuTe-DSL GEMM wheels come in two parts: scripts/gpu-quack.sh):
#
#   bash scripts/gpu.sh tests [PYTEST ARGS]   the CUDA tests (pytest -m cuda: kernels, sampler graphs, TP rules)
#   bash scripts/gpu.sh check [MODEL ...]     vexact-vllm check --against-stock on each built-in model (default:
#                                             every tiny model, DeepSeek-V3, V2-Lite and the Qwen3.5 / Qwen3-Next hybrids included, and
#                                             qwen3-1.7b-shape), then on qwen3-1.7b-shape with four 2,700-3,300-token
#                                             prompts (past the attention's 2,048-key split), then --prompt-logprobs 5
#                                             (tiny Qwen3, Qwen3-MoE, DeepSeek-V3, the long prompts on the 1.7B
#                                             shape); on two GPUs at tensor-parallel size 2 (tiny Llama, Qwen3-MoE,
#                                             both DeepSeeks) and pipeline-parallel size 2 (every tiny family, the
#                                             Qwen3-1.7B shape, an uneven VLLM_PP_LAYER_PARTITION), on four GPUs at
#                                             PP=2 x TP=2 as well
#   bash scripts/gpu.sh bench [BENCH ARGS]    vexact-vllm bench on the Qwen3-1.7B shape (dummy weights): stock vLLM,
#                                             stock batch-invariant and vexact, workloads default and grpo:32, side
#                                             by side on the GPU; BENCH ARGS override (e.g. --model qwen3-8b-shape).
#                                             Then vexact against stock on the Moonlight-16B-A3B shape (stock: its
#                                             latent MLA), on the Qwen3.5 4B and 35B-A3B shapes (the hybrids), and
#                                             prompt scoring (benchmarks/bench_prompt_scores.py). On two GPUs also
#                                             the exchange's paths (benchmarks/bench_tp_exchange.py), vexact at TP=2 and at PP=2
#                                             against stock at the same size (Qwen3-8B and Qwen3-30B-A3B shapes; BENCH ARGS apply there too)
#   bash scripts/gpu.sh verl                  verl's one-GPU GRPO smoke (examples/verl/smoke_1gpu.sh) on the tiny DeepSeek-V3,
#                                             FSDP and VeOmni engines: 0 with vexact, non-zero with stock
#   bash scripts/gpu.sh mla                   DeepSeek's MLA sizes: their CUDA tests, benchmarks/bench_mla.py (192/128 attention
#                                             against FA3 and stock's latent decode), bench_trainer on 4 Moonlight layers
#   bash scripts/gpu.sh gdn                   the Gated DeltaNet kernels: design C's sm_90a twin-dot inspection, their CUDA tests at Qwen3-Next/Qwen3.5 shapes,
#                                             then benchmarks/bench_gated_delta.py (the chunk-anchored incremental design against fla and
#                                             vLLM where importable: pip install fla-core==0.6.0 for fla)
#   bash scripts/gpu.sh all                   tests, check, bench, verl, mla, gdn
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

gpus() { nvidia-smi -L 2>/dev/null | wc -l; }

tests() {
  run tests "$py" -m pytest -q -m cuda tests "$@"
}

check() {
  local models=("$@") model prompts
  [ ${#models[@]} -gt 0 ] || models=(tiny-qwen3 tiny-qwen2 tiny-llama tiny-qwen3-moe tiny-deepseek-v3 tiny-deepseek-v2-lite tiny-qwen3.5 tiny-qwen3.5-moe tiny-qwen3-next qwen3-1.7b-shape)
  for model in "${models[@]}"; do
    run "check-$model" "$py" -m vexact_vllm.cli check --model "$model" --against-stock --quiet
  done
  # Prompt log-probs (a teacher's scores): every prompt token's log-prob, top 5 and rank against the trainer's.
  for model in tiny-qwen3 tiny-qwen3-moe tiny-deepseek-v3; do
    run "check-prompt-logprobs-$model" "$py" -m vexact_vllm.cli check --model "$model" --prompt-logprobs 5 --quiet
  done
  prompts=$(mktemp --suffix=.txt)
  long_prompts "$prompts"
  run check-long "$py" -m vexact_vllm.cli check --model qwen3-1.7b-shape --prompts "$prompts" --num-prompts 4 \
    --max-tokens 48 --max-model-len 4096 --quiet
  run check-long-prompt-logprobs "$py" -m vexact_vllm.cli check --model qwen3-1.7b-shape --prompts "$prompts" \
    --num-prompts 4 --max-tokens 48 --max-model-len 4096 --prompt-logprobs 5 --quiet
  rm -f "$prompts"
  if [ "$(gpus)" -ge 2 ]; then
    for model in tiny-llama tiny-qwen3-moe tiny-deepseek-v3 tiny-deepseek-v2-lite; do
      run "check-tp2-$model" "$py" -m vexact_vllm.cli check --model "$model" --tensor-parallel-size 2 --quiet
    done
    # Pipeline parallelism: every composition on each family (tied Qwen3/Qwen2: the last stage holds the
    # embedding as its lm_head), stock vLLM at PP=2 beside it; then the 28-layer shape split unevenly.
    for model in tiny-qwen3 tiny-qwen2 tiny-llama tiny-qwen3-moe tiny-deepseek-v3 qwen3-1.7b-shape; do
      run "check-pp2-$model" "$py" -m vexact_vllm.cli check --model "$model" --pipeline-parallel-size 2 \
        --against-stock --quiet
    done
    VLLM_PP_LAYER_PARTITION=20,8 run check-pp2-uneven "$py" -m vexact_vllm.cli check --model qwen3-1.7b-shape \
      --pipeline-parallel-size 2 --compositions batch,chunked-prefill,preemption --quiet
  fi
  if [ "$(gpus)" -ge 4 ]; then
    for model in tiny-qwen3-moe qwen3-1.7b-shape; do
      run "check-pp2-tp2-$model" "$py" -m vexact_vllm.cli check --model "$model" --pipeline-parallel-size 2 \
        --tensor-parallel-size 2 --quiet
    done
  fi
}

bench() {
  run bench "$py" -m vexact_vllm.cli bench --model qwen3-1.7b-shape --workload default,grpo:32 --interleave "$@"
  # DeepSeek (MLA): vexact's per-head K/V cache against stock's latent MLA (the target: >= 0.85x)
  run bench-moonlight "$py" -m vexact_vllm.cli bench --model moonlight-16b-a3b-shape --configs stock,vexact \
    --workload default,grpo:32 --interleave "$@"
  # The hybrids (Gated DeltaNet): Qwen3.5 at 4B and 35B-A3B in the published vision-language layout (stock
  # runs its language model only, both sides without prefix caching: cli/model_engine.py)
  for model in qwen3.5-4b-shape qwen3.5-35b-a3b-shape; do
    run "bench-$model" "$py" -m vexact_vllm.cli bench --model "$model" --configs stock,vexact \
      --workload default,grpo:32 --interleave "$@"
  done
  # A teacher's prompt scoring (prompt_logprobs 0 and 5), Qwen3-8B shape, 256 sequences of 1-2k tokens
  run bench-prompt-scores "$py" benchmarks/bench_prompt_scores.py --model qwen3-8b-shape \
    --output "${OUT:-.}/prompt_scores.jsonl"
  if [ "$(gpus)" -ge 2 ]; then  # TP=2: one exchange's paths, then vexact against stock at TP=2 (the target: >= 0.95x)
    run bench-tp-exchange "$py" benchmarks/bench_tp_exchange.py --json "${OUT:-.}/tp_exchange.json"
    for model in qwen3-8b-shape qwen3-30b-a3b-shape; do
      run "bench-tp2-$model" "$py" -m vexact_vllm.cli bench --model "$model" --tensor-parallel-size 2 \
        --configs stock,vexact --workload default,grpo:32 "$@"
    done
    # vexact at PP=2 against stock at PP=2 (the target: >= 0.95x)
    for model in qwen3-8b-shape qwen3-30b-a3b-shape; do
      run "bench-pp2-$model" "$py" -m vexact_vllm.cli bench --model "$model" --pipeline-parallel-size 2 \
        --configs stock,vexact --workload default,grpo:32 --interleave "$@"
    done
  fi
}

verl() {  # one GRPO step with vexact and one with stock on the tiny DeepSeek-V3, verl's FSDP and VeOmni engines
  run verl-deepseek-fsdp env MODEL=tiny-deepseek-v3 bash examples/verl/smoke_1gpu.sh
  run verl-deepseek-veomni env MODEL=tiny-deepseek-v3 MODEL_ENGINE=veomni bash examples/verl/smoke_1gpu.sh
}

mla() {
  run mla-tests "$py" -m pytest -q -m cuda tests/kernels/attention/test_head_sizes.py \
    tests/kernels/moe/test_routing_grouped.py tests/model_patches/test_tensor_parallel_deepseek.py
  run mla-kernels "$py" benchmarks/bench_mla.py --out "${OUT:-.}"
  run mla-trainer "$py" benchmarks/bench_trainer.py --shape moonlight-4l --json "${OUT:-.}/trainer_moonlight.json"
}

gdn() {
  run gdn-inspect "$py" benchmarks/inspect_gated_delta.py
  run gdn-tests "$py" -m pytest -q -m cuda tests/kernels -k "gated or conv1d"
  run gdn-bench "$py" benchmarks/bench_gated_delta.py --output "${OUT:-.}/bench_gated_delta.json" \
    --jsonl "${OUT:-.}/gdn_results.jsonl"
}

case "${1:-}" in
  tests|check|bench|verl|mla|gdn) step=$1; shift; "$step" "$@" ;;
  all) tests; check; bench; verl; mla; gdn ;;
  *) sed -n '2,30p' "$0" | cut -c3-; exit 2 ;;
esac
printf '%s\n' "${results[@]}"
[ ${#failed[@]} = 0 ]
