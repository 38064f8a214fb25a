#!/usr/bin/env bash
# GRPO | Qwen3 dense | GSM8K | vLLM rollouts | verl FSDP or VeOmni training
#
#   VEXACT=1 (default)  rollouts from vLLM with --model-impl vexact: verl's own metrics
#                       training/rollout_probs_diff_max and rollout_corr/k3_kl are exactly 0.
#   VEXACT=0            the same recipe on stock vLLM (model_impl unset): both are non-zero.
#   MODEL_ENGINE=fsdp (default) | veomni
#                       verl's own FSDP engine or VeOmni's (verl's `model_engine=dp|veomni`).
#
# The training side runs the shared model in both cases (actor_rollout_ref.model.external_lib), so
# VEXACT=0 vs 1 changes the rollout engine only. verify_rollout_match.sh runs the pair.
#
# Data: GSM8K prepared by verl's own preprocessing script, from a verl checkout:
#   python3 examples/data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k
# Extra Hydra overrides go after the script: bash run_qwen3_grpo_gsm8k.sh trainer.total_training_steps=5
# DRY_RUN=1 prints the overrides, one a line, and launches nothing (tests/examples/test_verl_recipe.py).

set -euo pipefail

# ---- user-adjustable ----
VEXACT=${VEXACT:-1}
MODEL_ENGINE=${MODEL_ENGINE:-fsdp}
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-1.7B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
TRAIN_FILE=${TRAIN_FILE:-$DATA_DIR/train.parquet}
TEST_FILE=${TEST_FILE:-$DATA_DIR/test.parquet}
NNODES=${NNODES:-1}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
PYTHON=${PYTHON:-python3}

TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-256}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-64}
MICRO_BATCH_SIZE_PER_GPU=${MICRO_BATCH_SIZE_PER_GPU:-4}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}
ACTOR_LR=${ACTOR_LR:-1e-6}
ROLLOUT_N=${ROLLOUT_N:-5}
ROLLOUT_GPU_MEM_UTIL=${ROLLOUT_GPU_MEM_UTIL:-0.6}
ROLLOUT_TP=${ROLLOUT_TP:-1}  # vLLM tensor-parallel size of each rollout replica (NGPUS_PER_NODE / ROLLOUT_TP replicas)
ROLLOUT_PP=${ROLLOUT_PP:-1}  # vLLM pipeline-parallel size of each replica (VEXACT=1 only; TP x PP GPUs a replica)
# vLLM prefix caching: on, except for Qwen3-Next / Qwen3.5 (Gated DeltaNet), whose vexact rollouts refuse it
# (the README says why); both rollouts run the same setting.
if [ -z "${PREFIX_CACHING:-}" ]; then
    PREFIX_CACHING=$("$PYTHON" -c 'import sys; from vexact_vllm.option_policy import prefix_caching
print(prefix_caching(sys.argv[1]))' "$MODEL_PATH" 2>/dev/null) || {
        echo "could not read the prefix-caching default with $PYTHON: install vexact-vllm there (PYTHON=...)" \
             "or set PREFIX_CACHING=True|False" >&2; exit 1; }
fi

PROJECT_NAME=${PROJECT_NAME:-vexact_grpo_gsm8k}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-qwen3_$([ "$VEXACT" = 1 ] && echo vexact || echo stock)_${MODEL_ENGINE}}
LOGGER=${LOGGER:-'["console","wandb"]'}
TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
SAVE_FREQ=${SAVE_FREQ:--1}
TEST_FREQ=${TEST_FREQ:-5}
# ---- end user-adjustable ----

case "$VEXACT" in
    1) ROLLOUT_IMPL=(+actor_rollout_ref.rollout.engine_kwargs.vllm.model_impl=vexact) ;;
    0) ROLLOUT_IMPL=() ;;
    *) echo "VEXACT must be 1 (vexact-vllm rollouts) or 0 (stock vLLM), got '$VEXACT'" >&2; exit 1 ;;
esac

# verl refuses pipeline-parallel vLLM rollouts; the training side lifts that for vexact rollouts only
# (model_patches/trainers/verl_hooks.py). verl builds the rollout config in its agent-loop workers
# before it imports external_lib, so a pipelined run turns the training side on in every verl process
# at `import verl` (verl's VERL_USE_EXTERNAL_MODULES, through Ray's runtime environment).
PIPELINE=()
if [ "$ROLLOUT_PP" != 1 ]; then
    if [ "$VEXACT" != 1 ]; then
        echo "ROLLOUT_PP=$ROLLOUT_PP needs VEXACT=1: verl refuses pipeline-parallel stock vLLM rollouts" >&2
        exit 1
    fi
    PIPELINE=(+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=vexact_vllm.model_patches.enable)
fi

case "$MODEL_ENGINE" in
    fsdp)
        ENGINE=(
            model_engine=dp
            actor_rollout_ref.actor.fsdp_config.param_offload=False
            actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
            actor_rollout_ref.ref.fsdp_config.param_offload=True
        ) ;;
    veomni)
        ENGINE=(
            model_engine=veomni
            actor_rollout_ref.actor.veomni.param_offload=False
            actor_rollout_ref.actor.veomni.optimizer_offload=False
            actor_rollout_ref.ref.veomni.param_offload=True
        ) ;;
    *) echo "MODEL_ENGINE must be fsdp or veomni, got '$MODEL_ENGINE'" >&2; exit 1 ;;
esac

DATA=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$TRAIN_FILE"
    data.val_files="$TEST_FILE"
    data.train_batch_size="$TRAIN_BATCH_SIZE"
    data.max_prompt_length="$MAX_PROMPT_LENGTH"
    data.max_response_length="$MAX_RESPONSE_LENGTH"
    data.filter_overlong_prompts=True
    data.truncation=error
)

MODEL=(
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=False  # supported; off: the tiny smoke saves nothing by it
    # The training side: verl's workers import this module, which makes them build and score with
    # the shared model (nothing else turns it on).
    actor_rollout_ref.model.external_lib=vexact_vllm.model_patches.enable
)

ACTOR=(
    actor_rollout_ref.actor.optim.lr="$ACTOR_LR"
    actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE"
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$MICRO_BATCH_SIZE_PER_GPU"
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
)

ROLLOUT=(
    actor_rollout_ref.rollout.name=vllm
    "${ROLLOUT_IMPL[@]}"
    # Tensor-parallel rollouts stay bitwise equal to the (FSDP, unsharded) trainer; must divide NGPUS_PER_NODE.
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
    # Pipeline-parallel rollouts too (whole layers per stage, hidden states and residual handed over).
    actor_rollout_ref.rollout.pipeline_model_parallel_size="$ROLLOUT_PP"
    "${PIPELINE[@]}"
    actor_rollout_ref.rollout.gpu_memory_utilization="$ROLLOUT_GPU_MEM_UTIL"
    actor_rollout_ref.rollout.n="$ROLLOUT_N"
    actor_rollout_ref.rollout.free_cache_engine=True
    actor_rollout_ref.rollout.enable_prefix_caching="$PREFIX_CACHING"
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$MICRO_BATCH_SIZE_PER_GPU"
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$MICRO_BATCH_SIZE_PER_GPU"
    # vLLM returns each sampled token's log-prob; verl logs training/rollout_probs_diff_max against
    # the trainer's recomputed old_log_probs.
    actor_rollout_ref.rollout.calculate_log_probs=True
)

# Rollout correction in decoupled mode (old_log_probs recomputed by the trainer), metrics only:
# verl logs rollout_corr/k3_kl, rollout_corr/kl, ... and applies no importance weights
# (set algorithm.rollout_correction.rollout_is=token to correct stock rollouts).
CORRECTION=(
    algorithm.rollout_correction.bypass_mode=False
    algorithm.rollout_correction.rollout_is=null
    algorithm.rollout_correction.rollout_rs=null
)

TRAINER=(
    trainer.critic_warmup=0
    trainer.logger="$LOGGER"
    trainer.project_name="$PROJECT_NAME"
    trainer.experiment_name="$EXPERIMENT_NAME"
    trainer.n_gpus_per_node="$NGPUS_PER_NODE"
    trainer.nnodes="$NNODES"
    trainer.save_freq="$SAVE_FREQ"
    trainer.test_freq="$TEST_FREQ"
    trainer.total_epochs="$TOTAL_EPOCHS"
)

ARGS=("${DATA[@]}" "${MODEL[@]}" "${ACTOR[@]}" "${ROLLOUT[@]}" "${CORRECTION[@]}" "${TRAINER[@]}" "${ENGINE[@]}" "$@")

if [ -n "${DRY_RUN:-}" ]; then
    printf '%s\n' "${ARGS[@]}"
    exit 0
fi

if [ ! -f "$TRAIN_FILE" ] || [ ! -f "$TEST_FILE" ]; then
    cat >&2 <<EOF
GSM8K not found at $TRAIN_FILE / $TEST_FILE. Prepare it with verl's script, from a verl checkout:
    python3 examples/data_preprocess/gsm8k.py --local_save_dir $DATA_DIR
or point DATA_DIR (or TRAIN_FILE and TEST_FILE) at the parquet files.
EOF
    exit 1
fi

set -x
"$PYTHON" -m verl.trainer.main_ppo "${ARGS[@]}"
