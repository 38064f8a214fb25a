"""Tensor parallelism emulated in one process: T ranks (threads, an all-gather over a barrier) each
build their shard of the decoder from the whole model's weights (cut as vLLM's `load_weights` cuts
them: `shard_of`) and run it; every rank's output must be `torch.equal` to the unsharded decoder's,
which is what the trainer (FSDP, TP = 1) runs. Random shapes (uneven column blocks included), every
family, T = 2, 4, 8 where the heads allow; the Triton path of the sharded layers under the
interpreter."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from vexact_vllm.model_patches import UnsupportedModelError
from vexact_vllm.model_patches.attention_context import PackedAttention
from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_patches.families import BY_MODEL_TYPE, FAMILIES
from vexact_vllm.model_patches.layers import pack_projections
from vexact_vllm.model_patches.models import build_decoder
from vexact_vllm.model_patches.moe import expert_rows, expert_tensor
from vexact_vllm.model_patches.tensor_parallel import (
    TensorParallel,
    check_tensor_parallel,
    shard_bounds,
    shard_of,
)


class ThreadGroup:
    """T ranks in T threads; `all_gather` is the collective (last dim, rank order). With `sums` (bytes),
    an all-reduce too, taking messages under that size (as vLLM's custom all-reduce sums: in fp32, rank
    order, then rounded to the buffer's dtype). One rank runs at a time (a lock released only inside the
    collective): Triton's interpreter is not thread-safe."""

    def __init__(self, size: int, sums: int = 0):
        self.size, self.slots, self.sums = size, [None] * size, sums
        self.barrier = threading.Barrier(size, timeout=120)
        self.lock = threading.Lock()
        self.calls = 0

    def rank(self, r: int) -> TensorParallel:
        def collective(x, combine):
            self.slots[r] = x
            self.lock.release()
            try:
                self.barrier.wait()
                out = combine(list(self.slots))
                self.barrier.wait()
            finally:
                self.lock.acquire()
            if r == 0:
                self.calls += 1
            return out

        def fp32_sum(slots):
            acc = slots[0].float()
            for other in slots[1:]:
                acc = acc + other.float()
            return acc.to(slots[0].dtype)

        def all_gather(x):
            return collective(x, lambda slots: torch.cat(slots, -1))

        if not self.sums:
            return TensorParallel(r, self.size, all_gather)
        return TensorParallel(r, self.size, all_gather, lambda buf: collective(buf, fp32_sum), lambda buf: True,
                              reduce_bytes=self.sums)  # fmt: skip

    def run(self, fn):
        """[fn(rank 0), ..., fn(rank T-1)], each in its own thread."""
        results, errors = [None] * self.size, []

        def work(r):
            self.lock.acquire()
            try:
                results[r] = fn(self.rank(r))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)
                self.barrier.abort()
            finally:
                self.lock.release()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _config(model_type: str, rng: random.Random, tp: int) -> DecoderConfig:
    family = BY_MODEL_TYPE[model_type]
    heads = tp * rng.choice([1, 2])
    kv = rng.choice([d for d in (1, 2, 4, heads) if heads % d == 0 and (d % tp == 0 or tp % d == 0)])
    head_dim = rng.choice([8, 16])
    fields = {**family.tiny, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
              "hidden_size": rng.choice([24, 40, 64]), "intermediate_size": rng.choice([36, 50, 96]),
              "num_hidden_layers": 2, "vocab_size": rng.choice([61, 96, 130])}  # fmt: skip
    if model_type != "llama":
        fields["attention_bias"] = rng.random() < 0.5
    if model_type == "qwen3_moe":
        fields.update(num_experts=rng.choice([3, 5]), num_experts_per_tok=2, moe_intermediate_size=rng.choice([20, 33]),
                      mlp_only_layers=[rng.choice([0, 1])])  # fmt: skip
    if family.hybrid:  # Gated DeltaNet: its key heads split over the ranks, the value heads 1 or 2 per key head
        key_heads = tp * rng.choice([1, 2])
        fields.update(linear_num_key_heads=key_heads, linear_num_value_heads=key_heads * rng.choice([1, 2]),
                      linear_key_head_dim=rng.choice([8, 16]), linear_value_head_dim=rng.choice([8, 16]),
                      linear_conv_kernel_dim=rng.choice([2, 3, 4]), head_dim=16,
                      layer_types=rng.sample(["linear_attention", "full_attention"], 2))  # fmt: skip
        if "num_experts" in family.tiny:
            fields.update(num_experts=rng.choice([3, 5]), moe_intermediate_size=rng.choice([20, 33]),
                          shared_expert_intermediate_size=rng.choice([24, 36]))  # fmt: skip
        if model_type == "qwen3_next":
            fields["mlp_only_layers"] = [rng.choice([0, 1])]
    return DecoderConfig.from_hf(family.hf_config_class()(**fields))


def _whole(config: DecoderConfig, seed: int):
    torch.manual_seed(seed)
    model = build_decoder(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return model.to(torch.bfloat16).eval()


def _per_expert(state: dict) -> dict:
    """A stacked-expert state dict renamed to the per-expert names of checkpoints on disk."""
    out = {}
    for name, t in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = t
            continue
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        for e in range(t.shape[0]):
            for part in parts:
                out[f"{name.rsplit('.', 1)[0]}.{e}.{part}.weight"] = expert_rows(t, e, part)
    return out


def rank_decoder(config, tp, state: dict):
    """This rank's decoder with the whole model's tensors `state` cut as `VllmVexactForCausalLM.load_weights`
    does (per-expert or stacked names)."""
    model = build_decoder(config, tp).to(torch.bfloat16).eval()
    pack_projections(model)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # buffers: DeepSeek's router bias
    for name, full in state.items():
        target = expert_tensor(name)
        if target is None:
            params[name].data.copy_(shard_of(params[name], full))
        else:
            param = params[target[0]]
            expert_rows(param.data, target[1], target[2]).copy_(shard_of(param, full, expert=True))
    return model


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("model_type", [f.model_type for f in FAMILIES if f.tiny is not None])
def test_every_rank_reproduces_the_unsharded_decoder(model_type, seed):
    rng = random.Random(f"{model_type}-{seed}")
    tp = [2, 4, 8][seed % 3]
    config = _config(model_type, rng, tp)
    whole = _whole(config, seed)
    lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
    ids = torch.randint(0, config.vocab_size, (sum(lens),))
    positions = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        want = whole(ids, positions, PackedAttention(cu))
    state = {k: v.detach() for k, v in whole.state_dict().items()}
    group = ThreadGroup(tp, sums=[0, 1 << 16, 600][seed // 2])  # all-gathers; sums (the tiny messages); each by its size

    def rank(r_tp):
        model = rank_decoder(config, r_tp, _per_expert(state) if seed % 2 else state)
        with torch.no_grad():
            return model(ids, positions, PackedAttention(cu))

    outs = group.run(rank)
    for r, out in enumerate(outs):
        assert torch.equal(out, want), (model_type, tp, r, config)
    per_layer = 4  # attention or Gated DeltaNet: heads, o_proj / out_proj; MLP or MoE: activation, down_proj
    # DeepSeek's shared experts and the hybrids' shared expert: the same two
    shared = sum(getattr(layer.mlp, "shared_experts", None) is not None or hasattr(layer.mlp, "shared_expert")
                 for layer in whole.layers)  # fmt: skip
    assert group.calls == per_layer * config.num_layers + 2 * shared


@pytest.mark.parametrize("n,size", [(7, 2), (8, 4), (130, 8), (3, 4)])
def test_blocks_cover_the_columns_in_rank_order(n, size):
    bounds = [shard_bounds(n, size, r) for r in range(size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert [b - a for a, b in bounds] == [len(c) for c in torch.arange(n).tensor_split(size)]
    full = torch.randn(3, n)
    for sums in (False, True):
        gathered = ThreadGroup(size, 1 << 16 if sums else 0).run(lambda tp: tp.gather(tp.take(full, 1), n))
        assert all(torch.equal(g, full) for g in gathered)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_over_negative_zero_keeps_every_value(dtype):
    """The exchange as an all-reduce: this rank's block over -0.0 elsewhere sums to the blocks, bit for
    bit, for subnormals, both zeros, inf and NaN (the CUDA twin: tests/vexact_vllm/test_tp_exchange_cuda.py)."""
    from tests.vexact_vllm.test_tp_exchange_cuda import same_bits, special_matrix

    for size, n in ((2, 97), (3, 64), (4, 130)):
        full = special_matrix(5, n, dtype, seed=size)
        for got in ThreadGroup(size, sums=1 << 16).run(lambda tp, full=full, n=n: tp.gather(tp.take(full, 1), n)):
            assert same_bits(got, full) is None


def test_head_splits_it_cannot_keep_are_refused():
    check_tensor_parallel(8, 2, 4)  # kv heads replicated: rank r holds kv head r * 2 // 4
    check_tensor_parallel(8, 8, 8)
    with pytest.raises(UnsupportedModelError, match="does not divide the 6 attention heads"):
        check_tensor_parallel(6, 2, 4)
    with pytest.raises(UnsupportedModelError, match="key/value heads"):
        check_tensor_parallel(12, 3, 4)


def test_interpreted_triton_sharded_moe(interpreted_modules):
    """The Triton path (interpreter): the sharded fused MoE of every rank, gathered, is the whole
    layer's output (column-sharded linears: tests/kernels/gemm/test_slices.py)."""
    import importlib

    importlib.import_module("vexact_vllm.kernels.gemm.linear_triton")  # compiled first, so it comes back after
    moe_triton = interpreted_modules(("vexact_vllm.kernels.moe.experts_triton", "vexact_vllm.kernels.moe.experts_triton_bwd",
                                      "vexact_vllm.kernels.moe.align_triton", "vexact_vllm.kernels.gemm.linear_triton"))[0]  # fmt: skip
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k, size = 5, 64, 48, 4, 2, 2
    x = torch.randn(tokens, hidden).bfloat16()
    w_gu = (torch.randn(experts, 2 * inter, hidden) / 8).bfloat16()
    w_d = (torch.randn(experts, hidden, inter) / 8).bfloat16()
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k), -1)
    want = moe_triton.fused_moe_triton(x, w_gu, w_d, ids, weights)
    group = ThreadGroup(size)

    def rank(tp):
        gu = tp.take_halves(w_gu, 1).contiguous()
        d = tp.take(w_d, 1).contiguous()
        out = moe_triton.fused_moe_sharded_triton(x, gu, d, ids, weights, lambda a: tp.gather(a, inter), inter, hidden)
        return tp.gather(out, hidden)

    assert all(torch.equal(out, want) for out in group.run(rank))


# --- CUDA: the compiled Triton kernels at real shapes ---------------------------------------------

# (hidden, heads, kv heads, head_dim, intermediate, vocabulary): Qwen3-1.7B, Llama-3.2-1B, Qwen3-8B
_REAL = [(2048, 16, 8, 128, 6144, 151936), (2048, 32, 8, 64, 8192, 128256), (4096, 32, 8, 128, 12288, 151936)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", _REAL)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_cuda_ranks_reproduce_the_unsharded_decoder(shape, tp):
    """Two Qwen3 layers of a real model's width on the GPU, T ranks as threads: every rank's hidden
    states and the gathered vocabulary-sharded fp32 logits equal the unsharded ones."""
    from transformers import Qwen3Config

    from vexact_vllm.kernels import linear

    hidden, heads, kv, head_dim, inter, vocab = shape
    config = DecoderConfig.from_hf(Qwen3Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                                               head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                                               num_hidden_layers=2, tie_word_embeddings=True))  # fmt: skip
    torch.manual_seed(tp)
    with torch.device("cuda"):
        whole = build_decoder(config)
        with torch.no_grad():
            for p in whole.parameters():
                p.copy_(torch.randn(p.shape) * 0.02)
        whole = whole.to(torch.bfloat16).eval()
        lens = [300, 1, 57]
        ids = torch.randint(0, vocab, (sum(lens),))
        positions = torch.cat([torch.arange(n) for n in lens])
        cu = torch.tensor([0, 300, 301, 358], dtype=torch.int32)
    with torch.no_grad():
        want = whole(ids, positions, PackedAttention(cu))
        want_logits = linear(want, whole.embed_tokens.weight, out_dtype=torch.float32)
    state = {k: v.detach() for k, v in whole.state_dict().items()}

    def rank(r_tp):
        with torch.device("cuda"):
            model = rank_decoder(config, r_tp, state)
        with torch.no_grad():
            out = model(ids, positions, PackedAttention(cu))
            lm_head = r_tp.take(model.embed_tokens.weight)
            logits = linear(out, lm_head, out_dtype=torch.float32, config_n=vocab)
            return out, r_tp.gather(logits, vocab)

    for r, (out, logits) in enumerate(ThreadGroup(tp).run(rank)):
        assert torch.equal(out, want), r
        assert torch.equal(logits, want_logits), r


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_cuda_sharded_moe_at_30b_a3b_shapes(tp):
    from vexact_vllm.kernels import fused_moe
    from vexact_vllm.kernels.moe.experts import fused_moe_sharded
    from vexact_vllm.kernels.moe.routing import route

    torch.manual_seed(tp)
    tokens, hidden, inter, experts, top_k = 1000, 2048, 768, 128, 8
    with torch.device("cuda"):
        x = torch.randn(tokens, hidden).bfloat16()
        w_gu = (torch.randn(experts, 2 * inter, hidden) * 0.02).bfloat16()
        w_d = (torch.randn(experts, hidden, inter) * 0.02).bfloat16()
        weights, ids = route(torch.randn(tokens, experts), top_k, True)
    want = fused_moe(x, w_gu, w_d, ids, weights)

    def rank(r_tp):
        gu, d = r_tp.take_halves(w_gu, 1).contiguous(), r_tp.take(w_d, 1).contiguous()
        out = fused_moe_sharded(x, gu, d, ids, weights, lambda a: r_tp.gather(a, inter), inter, hidden)
        return r_tp.gather(out, hidden)

    assert all(torch.equal(out, want) for out in ThreadGroup(tp).run(rank))
