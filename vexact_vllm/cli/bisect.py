"""`vexact-vllm check --bisect`: find the first op whose output differs between inference and training.

For one sequence (prompt + generated tokens) the shared model runs twice in this process with the
training weights: once as the trainer does (the whole sequence packed, `PackedAttention`), once as
vLLM does (`ReplayAttention`: prefill in chunks, then one token per step, each step writing its keys
and values into a paged cache and attending over it with `kernels.paged_attention`). Every module's
output, and every attention call, is recorded per position; the report names the first one, in
execution order, whose bits differ, with the position and both values. If the replay agrees
everywhere while vLLM disagrees with the trainer, the difference lies in the vLLM integration
(metadata, cache layout, sampler), not in the model or the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vexact_vllm.kernels import paged_attention, write_kv_cache
from vexact_vllm.model_patches.attention_context import PackedAttention


class ReplayAttention:
    """AttentionContext over a private paged KV cache, fed step by step like vLLM feeds it. A layer's
    cache is made at its first call, shaped as its keys and values; where the values are the keys'
    first cells (DeepSeek's latent), the value cache is that view of the key cache, as in vLLM."""

    def __init__(self, config, length: int, block_size: int, dtype, device):
        del config  # the shapes come from each layer's first keys and values
        self.blocks = -(-length // block_size)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        # blocks in reverse order: the cache is paged, not contiguous in position
        self.block_table = torch.arange(self.blocks - 1, -1, -1, dtype=torch.int32, device=device)[None]
        self.block_size = block_size
        self.dtype, self.device = dtype, device
        self.start = 0  # absolute position of the first token of the current step

    def _caches(self, layer_idx, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.k:
            pages = (self.blocks, self.block_size)
            self.k[layer_idx] = torch.zeros(*pages, *k.shape[1:], dtype=self.dtype, device=self.device)
            in_keys = v.data_ptr() == k.data_ptr() and v.shape[:-1] == k.shape[:-1]
            self.v[layer_idx] = (self.k[layer_idx][..., : v.shape[-1]] if in_keys
                                 else torch.zeros(*pages, *v.shape[1:], dtype=self.dtype, device=self.device))  # fmt: skip
        return self.k[layer_idx], self.v[layer_idx]

    def attend(self, layer_idx, q, k, v, scale):
        n = q.shape[0]
        k_cache, v_cache = self._caches(layer_idx, k, v)
        pos = torch.arange(self.start, self.start + n, device=q.device)
        slots = self.block_table[0, pos // self.block_size].long() * self.block_size + pos % self.block_size
        write_kv_cache(k, v, k_cache, v_cache, slots)
        seq_lens = torch.tensor([self.start + n], dtype=torch.int32, device=q.device)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        return paged_attention(q, k_cache, v_cache, self.block_table, seq_lens, qsl, scale)


class _Recorder:
    """Forward hooks on every module: output rows by absolute position, in first-call order."""

    def __init__(self, model: torch.nn.Module):
        self.order: list[str] = []
        self.rows: dict[str, dict[int, torch.Tensor]] = {}
        self.positions: torch.Tensor | None = None
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if name]

    def _hook(self, name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if not isinstance(out, torch.Tensor) or out.shape[0] != self.positions.numel():
                return
            self.record(name, out)

        return hook

    def record(self, name: str, out: torch.Tensor) -> None:
        if name not in self.rows:
            self.order.append(name)
            self.rows[name] = {}
        for i, p in enumerate(self.positions.tolist()):
            self.rows[name][p] = out[i].detach().clone()

    def close(self):
        for h in self.handles:
            h.remove()


class _RecordedAttention:
    """Wraps a context so each attention call is recorded as `<layer>.attention`."""

    def __init__(self, inner, recorder: _Recorder):
        self.inner, self.recorder = inner, recorder

    def attend(self, layer_idx, q, k, v, scale):
        out = self.inner.attend(layer_idx, q, k, v, scale)
        self.recorder.record(f"model.layers.{layer_idx}.self_attn.attention", out)
        return out


@dataclass
class Divergence:
    module: str
    position: int
    inference: float
    training: float
    max_abs_diff: float


def _run(decoder, ids, steps, ctx_factory) -> _Recorder:
    recorder = _Recorder(decoder)
    ctx = _RecordedAttention(ctx_factory(), recorder)
    try:
        with torch.no_grad():
            for lo, hi in steps:
                recorder.positions = torch.arange(lo, hi, device=ids.device)
                if hasattr(ctx.inner, "start"):
                    ctx.inner.start = lo
                decoder(ids[lo:hi], recorder.positions, ctx)
    finally:
        recorder.close()
    return recorder


def bisect_sequence(
    model, token_ids: list[int], prompt_len: int, chunk: int = 32, block_size: int = 16, replay_cls=ReplayAttention
):
    """First divergence between the replayed inference steps and the packed training forward of
    one sequence, or None when every recorded output is bitwise equal."""
    decoder = model.model
    device = model.lm_head.weight.device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    n = ids.numel()
    prefill = [(lo, min(lo + chunk, prompt_len)) for lo in range(0, prompt_len, chunk)]
    steps = prefill + [(p, p + 1) for p in range(prompt_len, n)]
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    train = _run(decoder, ids, [(0, n)], lambda: PackedAttention(cu))
    dtype = model.lm_head.weight.dtype
    infer = _run(decoder, ids, steps, lambda: replay_cls(decoder.config, n, block_size, dtype, device))
    for name in train.order:
        for p in range(n):
            a, b = infer.rows.get(name, {}).get(p), train.rows[name].get(p)
            if a is None or b is None or torch.equal(a, b):
                continue
            diff = (a.double() - b.double()).abs()
            k = int(diff.reshape(-1).argmax())
            return Divergence(name, p, float(a.reshape(-1)[k]), float(b.reshape(-1)[k]), float(diff.max()))
    return None


def describe(divergence: Divergence | None) -> str:
    if divergence is None:
        return (
            "bisect: the inference replay equals the training forward at every module and position; "
            "a vLLM mismatch then comes from the vLLM integration (metadata, cache layout, sampler)"
        )
    d = divergence
    return (
        f"bisect: first divergence at {d.module}, position {d.position}: inference {d.inference!r} "
        f"vs training {d.training!r} (max |diff| {d.max_abs_diff:.3g})"
    )
