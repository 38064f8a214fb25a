#!/usr/bin/env bash
# The verify pair: run_qwen3_grpo_gsm8k.sh for a few steps with vexact-vllm rollouts (VEXACT=1), then
# with stock vLLM (VEXACT=0), same data, seeds and trainer; then verl's own rollout/trainer metrics
# side by side, per step:
#   training/rollout_probs_diff_max  max |p_rollout - p_trainer| over the batch's response tokens
#   rollout_corr/k3_kl               K3 estimate of KL(pi_rollout || pi_trainer)
# Passes when every vexact step reports exactly 0 for both and the stock run reports them too.
#
#   STEPS=2 LOG_DIR=./vexact-verify MODEL_ENGINE=fsdp bash verify_rollout_match.sh [overrides...]
# The recipe's variables (MODEL_PATH, DATA_DIR, NGPUS_PER_NODE, ...) pass through; so do extra Hydra
# overrides. DRY_RUN=1 writes each run's overrides to its log instead of training. RUNS picks the
# runs ("1 0" by default; "1" or "0" for one side, "" to only compare the logs already in LOG_DIR).
# ROLLOUT_PP=N pipelines the vexact side's rollouts; verl refuses pipelined stock vLLM rollouts, so the
# stock side then runs unpipelined (ROLLOUT_PP=1, more replicas on the same GPUs).

set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
STEPS=${STEPS:-2}
RUNS=${RUNS-1 0}
LOG_DIR=${LOG_DIR:-./vexact-verify-logs}
METRICS=(training/rollout_probs_diff_max rollout_corr/k3_kl)
mkdir -p "$LOG_DIR"

SHORT=(
    trainer.total_training_steps="$STEPS"
    trainer.val_before_train=False
    trainer.test_freq=-1
    trainer.save_freq=-1
    'trainer.logger=["console"]'
)

for vexact in $RUNS; do
    log="$LOG_DIR/vexact$vexact.log"
    pp=${ROLLOUT_PP:-1}
    [ "$vexact" = 0 ] && pp=1  # verl refuses pipelined stock vLLM rollouts
    echo "== VEXACT=$vexact ROLLOUT_PP=$pp -> $log"
    VEXACT=$vexact ROLLOUT_PP=$pp bash "$HERE/run_qwen3_grpo_gsm8k.sh" "${SHORT[@]}" "$@" 2>&1 | tee "$log"
done

[ -n "${DRY_RUN:-}" ] && exit 0

# verl's console logger prints one line a step, "step:N - key:value - key:value ...", behind Ray's
# "(TaskRunner pid=...)" prefix.
metric() {  # metric LOG KEY -> "step value" lines (none when LOG is missing)
    [ -f "$1" ] || return 0
    awk -v key="$2" 'match($0, /step:[0-9]+ - /) {
        n = split(substr($0, RSTART), f, " - ")
        for (i = 2; i <= n; i++) {
            j = index(f[i], ":")
            if (substr(f[i], 1, j - 1) == key) print substr(f[1], 6), substr(f[i], j + 1)
        }
    }' "$1"
}

status=0
for side in 1 0; do  # a side not run yet (RUNS names one side, or it failed before training)
    if ! grep -q "step:[0-9]" "$LOG_DIR/vexact$side.log" 2>/dev/null; then
        echo "no training step logged in $LOG_DIR/vexact$side.log: run that side (RUNS=$side) first" >&2
        status=1
    fi
done
[ "$status" = 0 ] || exit 1  # nothing to compare yet
printf '\n%-34s %6s %16s %16s\n' metric step vexact stock
for key in "${METRICS[@]}"; do
    vexact_rows=$(metric "$LOG_DIR/vexact1.log" "$key")
    stock_rows=$(metric "$LOG_DIR/vexact0.log" "$key")
    if [ -z "$vexact_rows" ] || [ -z "$stock_rows" ]; then
        echo "$key: not logged (is actor_rollout_ref.rollout.calculate_log_probs on?)" >&2
        status=1
        continue
    fi
    awk -v key="$key" 'NR == FNR { stock[$1] = $2; next }
        { printf "%-34s %6s %16s %16s\n", key, $1, $2, ($1 in stock ? stock[$1] : "-") }' \
        <(echo "$stock_rows") <(echo "$vexact_rows")
    if echo "$vexact_rows" | awk '$2 !~ /^-?0(\.0+)?$/ { bad = 1 } END { exit !bad }'; then
        echo "FAIL: vexact rollouts report a non-zero $key" >&2
        status=1
    fi
done
# Step time and its parts, vexact beside stock (reported, not judged).
printf '\n%-34s %6s %16s %16s\n' timing step vexact stock
for key in timing_s/step timing_s/gen timing_s/old_log_prob timing_s/update_actor timing_s/update_weights; do
    vexact_rows=$(metric "$LOG_DIR/vexact1.log" "$key")
    stock_rows=$(metric "$LOG_DIR/vexact0.log" "$key")
    { [ -z "$vexact_rows" ] || [ -z "$stock_rows" ]; } && continue
    awk -v key="$key" 'NR == FNR { stock[$1] = $2; next }
        { printf "%-34s %6s %16.2f %16s\n", key, $1, $2, ($1 in stock ? sprintf("%.2f", stock[$1]) : "-") }' \
        <(echo "$stock_rows") <(echo "${vexact_rows:-}")
done
[ "$status" = 0 ] && echo "PASS: vexact rollouts equal the trainer's log-probs (both metrics 0 at every step)"
exit "$status"
