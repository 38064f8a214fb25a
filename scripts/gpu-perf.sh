#!/usr/bin/env bash
# Issue 13's round on the GPU host, in phases, after vLLM is staged there (../shared/gpu/README.md:
# three transfers; the project installed with `python3 -m pip install --no-deps --no-build-isolation -e .`).
#
#   OUT=DIR bash scripts/gpu-perf.sh PHASE [PHASE ...]
#
# Phases (each one log DIR/PHASE.log, its summary lines printed; the device tool returns at most 8
# files, so one phase one file). Limits are what each took on an H100 plus a margin, so that a call
# of several phases stays inside the tool's 600 s:
#   tests       CUDA tests of the attention, sampling, gather, RoPE, norm and GEMM kernels and the sampler
#               graphs (those need vLLM: run this phase after the third transfer)                ~150 s
#   check       vexact-vllm check on the Qwen3-1.7B shape, every composition (the default key
#               split, 2,048, as in every phase that does not set VEXACT_KEY_SPLIT)               ~230 s
#   check-long  the same with four 2,700-3,300-token prompts                                    ~250 s
#   check-split check-long with VEXACT_KEY_SPLIT=2048 set (the default since session 28)         ~250 s
#   check-nosplit check-long with VEXACT_KEY_SPLIT=0                                           ~250 s
#   check-many  the tiny Qwen3 with 80 prompts: batches of 64 requests or more                 ~180 s
#   bench       default, decode-small and grpo (32 prompts x 8) side by side, one engine pair    ~450 s
#   bench-8b    default and grpo (32 x 8) on the Qwen3-8B shape, one engine pair                ~500 s
#   bench-ab    vexact against itself without the key split and with the shared-prompt groups,
#               default and grpo, 3 engines                                                     ~450 s
#   kernels     bench_kernels.py: q/k norm + RoPE vs vLLM's ops, decode and prefill attention vs FA3,
#               training attention                                                              ~170 s
#   rollout     bench_kernels.py's rollout section: decode steps shaped like grpo (32 prompts x 8
#               sharing prompt blocks) and long, each speed-only paged launch choice vs FA3      ~120 s
#   split       key splits (C = 2,048) at kernel level: the CUDA split tests, train-attn unsplit
#               and split                                                                       ~150 s
#   profile-8b  where the 8B default and decode-small (600 output tokens) steps go, stock and
#               vexact each alone, by category (benchmarks/profile_steps.py)                     ~360 s
#   profile-8b-grpo  the same for grpo:16 (700 output tokens)                                    ~210 s
#   bench-split the 1.7B A/B of the split: stock, vexact (split 2,048, the default) and
#               vexact-nosplit; default, decode-small, grpo:32, one run                         ~470 s
#   gemm        the GEMM CUDA tests (BLOCK_K invariance, every card's tiles, split graphs)     ~150 s
#   gemm-8b     sweep_gemm.py on the 8B shapes, cold: decode tiles of any BLOCK_K at M = 1-128; it
#               prints `_TUNED_ON` entries for this card (kernels/gemm_triton.py)               ~150 s
#   gemm-8b-mid the same for the M = 192-512 buckets (every small tile, pointer, TMA, TMA with warp
#               specialization; the lm_head too; the 8B's ran past 400 s on an H200: run it alone)  ~450 s
#   gemm-1.7b, gemm-1.7b-mid  the same for the 1.7B shapes
set -uo pipefail
: "${OUT:?set OUT to the folder the logs go to}"
cd "$(dirname "$0")/.."
[ -f /opt/vx/env.sh ] && source /opt/vx/env.sh
export PYTHONUNBUFFERED=1
start=$(date +%s)

run() {  # run NAME LIMIT CMD...: the command's output into $OUT/NAME.log, its exit and seconds printed
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc $(( $(date +%s) - t0 )) s (at $(( $(date +%s) - start )) s): $*" | cut -c1-240
  return $rc
}

summary() {  # the report lines of a check or bench log
  grep -E "^(engine|vexact |stock |configuration|PASS|FAIL|qwen3|workload)|mismatch" "$1" | grep -v "INFO\|WARNING" | tail -40
}

long_prompts() {
  python3 - "$1" <<'PY'
import random, sys
rng = random.Random(5)
words = ("the of and to in is was for on that with as by at from his her an which were are this be had not have or "
         "their one all its also new first two has been other after more into time who some would can only most").split()
with open(sys.argv[1], "w") as f:
    for n in (900, 950, 1000, 1100):  # 2,700-3,300 tokens of the built-in tokenizer
        f.write(" ".join(rng.choice(words) + (str(rng.randrange(100)) if rng.random() < 0.2 else "") for _ in range(n)) + "\n")
PY
}

check_long() {  # check_long NAME: the 1.7B check on four 2,700-3,300-token prompts, into $OUT/NAME.log
  long_prompts /tmp/vexact-long-prompts.txt
  run "$1" 400 vexact-vllm check --model qwen3-1.7b-shape --prompts /tmp/vexact-long-prompts.txt \
    --num-prompts 4 --max-tokens 48 --max-model-len 4096 --quiet
  summary "$OUT/$1.log"
}

B17="vexact-vllm bench --model qwen3-1.7b-shape --interleave --configs stock,vexact"
for phase in "$@"; do
  case $phase in
    tests)
      run tests 300 python3 -m pytest -q -m cuda tests/kernels/test_attention_triton.py tests/kernels/test_sample.py \
        tests/kernels/test_gumbel_triton.py tests/kernels/test_logprob_triton.py tests/kernels/test_gemm_triton.py \
        tests/kernels/test_gather_triton.py tests/kernels/test_rope_triton.py tests/kernels/test_rms_norm_triton.py \
        tests/vexact_vllm/test_sampler_graphs.py
      tail -3 "$OUT/tests.log" ;;
    check)
      run check 400 vexact-vllm check --model qwen3-1.7b-shape --num-prompts 6 --max-tokens 16 --quiet
      summary "$OUT/check.log" ;;
    check-long)
      check_long check-long ;;
    check-split)
      VEXACT_KEY_SPLIT=2048 check_long check-split ;;
    check-nosplit)
      VEXACT_KEY_SPLIT=0 check_long check-nosplit ;;
    profile-8b|profile-8b-grpo)
      P8="vexact-vllm bench --model qwen3-8b-shape --configs vexact,stock --repeats 1 --duration 0 --warmup-passes 0"
      if [ "$phase" = profile-8b ]; then
        cases="default:60:--workload=default decode-small:300:--workload=decode-small,--output-len=600"
      else
        cases="grpo:450:--workload=grpo:16,--output-len=700"
      fi
      for c in $cases; do
        name=${c%%:*}; rest=${c#*:}; skip=${rest%%:*}; flags=${rest#*:}
        run "$phase" 300 $P8 ${flags//,/ } --profile "/tmp/prof-$name" --profile-steps "$skip:20"
        python3 benchmarks/profile_steps.py "/tmp/prof-$name" --steps 20 --top 4 | tee -a "$OUT/$phase.log"
      done ;;
    check-many)
      run check-many 400 vexact-vllm check --model tiny-qwen3 --num-prompts 80 --max-tokens 24 --quiet
      summary "$OUT/check-many.log" ;;
    bench)
      run bench 570 $B17 --workload default,decode-small,grpo:32 --repeats 3 --duration 8
      summary "$OUT/bench.log" ;;
    bench-8b)
      run bench-8b 570 ${B17/qwen3-1.7b-shape/qwen3-8b-shape} --workload default,grpo:32 --repeats 2 --duration 8
      summary "$OUT/bench-8b.log" ;;
    bench-ab)
      run bench-ab 570 ${B17/stock,vexact/vexact,vexact-nosplit,vexact-shared-prefix} --workload default,grpo:32 \
        --repeats 2 --duration 8
      summary "$OUT/bench-ab.log" ;;
    kernels)
      run kernels 300 python3 benchmarks/bench_kernels.py --only rope,decode,prefill,train-attn --paged-stages 5,7 --out "$OUT"
      sed -n '/^section    case/,$p' "$OUT/kernels.log" ;;
    rollout)
      run rollout 240 python3 benchmarks/bench_kernels.py --only rollout --out "$OUT"
      sed -n '/^section    case/,$p' "$OUT/rollout.log" ;;
    split)
      run split 200 python3 -m pytest -q -m cuda tests/kernels/test_attention_key_split.py
      tail -1 "$OUT/split.log"
      for C in 0 2048; do
        VEXACT_KEY_SPLIT=$C run split 100 python3 benchmarks/bench_kernels.py --only train-attn --out "$OUT"
      done
      grep -E "fwd\+bwd vs SDPA  " "$OUT/split.log" ;;
    bench-split)
      run bench-split 570 ${B17/stock,vexact/stock,vexact,vexact-nosplit} \
        --workload default,decode-small,grpo:32 --repeats 1 --duration 0
      grep -E "output tok/s" "$OUT/bench-split.log" ;;
    gemm)
      run gemm 300 python3 -m pytest -q -m cuda tests/kernels/test_gemm_triton.py tests/kernels/test_gemm_split_graphs.py
      tail -1 "$OUT/gemm.log" ;;
    gemm-8b|gemm-1.7b)
      run "$phase" 280 python3 benchmarks/sweep_gemm.py --shapes "qwen3-${phase#gemm-}" --narrow --any-k --cold \
        --ms 1,16,64,128
      sed -n '/^_TUNED_ON entries/,$p' "$OUT/$phase.log" ;;
    gemm-8b-mid|gemm-1.7b-mid)
      shapes=${phase#gemm-}
      run "$phase" 560 python3 benchmarks/sweep_gemm.py --shapes "qwen3-${shapes%-mid}" --small --any-k --tma --cold \
        --ms 192,256,384,512
      sed -n '/^_TUNED_ON entries/,$p' "$OUT/$phase.log" ;;
    *)
      echo "unknown phase $phase (tests check check-long check-split check-nosplit check-many bench bench-8b bench-ab kernels rollout split bench-split profile-8b profile-8b-grpo gemm gemm-8b gemm-8b-mid gemm-1.7b gemm-1.7b-mid)"; exit 2 ;;
  esac
done
