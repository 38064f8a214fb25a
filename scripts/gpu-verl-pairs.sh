#!/usr/bin/env bash
# The GPU host (after vLLM's parts and .gpu/v1 are staged): verl GRPO smoke launches, all at once, on
# the host's GPUs (NGPUS, default 2). Each argument is NAME:MODEL:ENGINE:TP:SIDES, MODEL a built-in
# (tiny-qwen3, tiny-qwen3-moe, qwen3-1.7b-shape...), ENGINE fsdp or veomni, TP the rollout's
# tensor-parallel size, SIDES "10" for vexact and stock. Logs and each pair's verify table under $OUT/NAME:
#   OUT=/root/out bash scripts/gpu-verl-pairs.sh fsdp:tiny-qwen3:fsdp:1:10 tp2:tiny-qwen3:fsdp:2:10
# Each launch runs in its own mount namespace (root: unshare) with a private /tmp: verl names its
# weight-sync socket /tmp/rl-colocate-zmq-<Ray job id>-..., and every fresh Ray cluster's first job is
# 01000000, so two launches would share it. The KV cache is fixed at KV_BYTES a replica (default 4 GiB;
# kv_cache_memory_bytes), so vLLM's start-up profiling does not measure the other launches' memory.
# Step times of launches that share the GPUs are not stock-vs-vexact timings.
set -uo pipefail
source /opt/vx/env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T=${LAUNCH_TIMEOUT:-540}
KV_BYTES=${KV_BYTES:-4294967296}
unshare -m --propagation private true || { echo "no unshare here" >&2; exit 3; }
for spec in "$@"; do
  IFS=: read -r name model engine tp sides <<<"$spec"
  path=$(python3 -c "from vexact_vllm.tiny_model import builtin_model; print(builtin_model('$model'))")
  mkdir -p "$OUT/$name"
  for side in $(echo "$sides" | grep -o .); do
    tmpd=/var/tmp/vx-$name-$side; mkdir -p "$tmpd"
    ( t0=$(date +%s) try=1
      while :; do
        left=$(( T - ($(date +%s) - t0) ))
        RUNS=$side STEPS=${STEPS:-5} NGPUS_PER_NODE=${NGPUS:-2} ROLLOUT_TP=$tp MODEL_ENGINE=$engine MODEL_PATH=$path \
        ROLLOUT_GPU_MEM_UTIL=0.1 WORK=/root/vxw-$name-$side LOG_DIR=$OUT/$name \
        timeout -k 10 $left unshare -m --propagation private bash -c "mount --bind $tmpd /tmp && exec bash examples/verl/smoke_1gpu.sh +actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=$KV_BYTES" \
          > "$OUT/$name/launch$side.out" 2>&1
        rc=$?
        # Launches side by side race for free ports (a free port is picked, then bound later): one that
        # lost (EADDRINUSE, seen once in session 31) goes again, once, if its time allows a launch.
        [ $rc != 0 ] && [ $try = 1 ] && [ $(( T - ($(date +%s) - t0) )) -gt 300 ] \
          && grep -q EADDRINUSE "$OUT/$name/vexact$side.log" 2>/dev/null || break
        try=2; mv "$OUT/$name/vexact$side.log" "$OUT/$name/vexact$side.try1.log"
      done
      # rc is verify's: a side launched alone fails its comparison while the other side's log is not
      # there yet, so steps (verl's console lines) tells whether it trained; the pairs are judged below.
      steps=$(grep -c "step:[0-9]" "$OUT/$name/vexact$side.log" 2>/dev/null)
      echo "$name side=$side rc=$rc steps=${steps:-0} tries=$try wall=$(( $(date +%s) - t0 ))s" >> "$OUT/summary.txt" ) &
    sleep 3
  done
done
wait
for spec in "$@"; do
  name=${spec%%:*}
  echo "=== $spec"
  RUNS="" LOG_DIR=$OUT/$name bash examples/verl/verify_rollout_match.sh 2>&1 | tee "$OUT/$name/verify.txt" | tail -22
done
cat "$OUT/summary.txt"
ray stop --force >/dev/null 2>&1; pkill -9 -f "vllm|ray::|main_ppo" >/dev/null 2>&1; true
