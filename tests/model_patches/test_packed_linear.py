"""PackedLinear / pack_projections: q/k/v and gate/up as one GEMM each, Hugging Face names kept.

On CPU (the torch kernels) an output element's bits depend only on K, so the fused GEMM must equal
the per-part `linear` calls bit for bit, and the whole model must equal the unfused three-GEMM model
(contiguous q/k/v, gate/up concatenated after two GEMMs), whose forward is kept inline here. Packing
(`pack_projections`, the inference layout) must change no name, shape, state_dict key or bit, and
in-place weight writes (load_weights, RL weight sync, vLLM's dummy loader) must reach the packed rows.
"""

import copy

import pytest
import torch

from vexact_vllm.kernels import apply_rope, linear, silu_and_mul, varlen_attention, write_kv_cache
from vexact_vllm.model_patches import PackedBatch
from vexact_vllm.model_patches.attention_context import PackedAttention
from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_patches.layers import MLP, Linear, PackedLinear, SelfAttention, pack_projections
from vexact_vllm.model_patches.models import build_decoder

ARCHS = ["qwen3", "qwen2", "llama"]
VOCAB = 448
LENGTHS = (5, 70, 12)  # one sequence spans two attention key tiles
DTYPES = [torch.bfloat16, torch.float32]


# ---------------------------------------------------------------- helpers


def _biased_llama(dtype=torch.float32) -> torch.nn.Module:
    """A random-weight Llama decoder with every bias (q/k/v/o: attention_bias, gate/up/down: mlp_bias)."""
    config = DecoderConfig(
        model_type="llama", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=256, rope_theta=1e4,
        qkv_bias=True, o_bias=True, mlp_bias=True,
    )  # fmt: skip
    model = build_decoder(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.to(dtype)


def _decoders(load_model, dtype):
    """(name, decoder) for the three tiny checkpoints and the all-bias Llama."""
    out = [(arch, load_model(arch, dtype, True).model) for arch in ARCHS]
    return out + [("llama_all_bias", _biased_llama(dtype))]


def _expected_keys(config: DecoderConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The decoder's state_dict as it was before PackedLinear: Hugging Face names, in order."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    keys = [("embed_tokens.weight", (config.vocab_size, h))]
    for n in range(config.num_layers):
        p = f"layers.{n}."
        keys.append((p + "input_layernorm.weight", (h,)))
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            keys.append((p + f"self_attn.{name}.weight", (rows, h)))
            if config.qkv_bias:
                keys.append((p + f"self_attn.{name}.bias", (rows,)))
        keys.append((p + "self_attn.o_proj.weight", (h, q)))
        if config.o_bias:
            keys.append((p + "self_attn.o_proj.bias", (h,)))
        if config.qk_norm:
            keys += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        keys.append((p + "post_attention_layernorm.weight", (h,)))
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            keys.append((p + f"mlp.{name}.weight", shape))
            if config.mlp_bias:
                keys.append((p + f"mlp.{name}.bias", shape[:1]))
    keys.append(("norm.weight", (h,)))
    return keys


def _listing(items) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in items]


def _hidden(decoder, seqs) -> torch.Tensor:
    batch = PackedBatch.from_sequences(seqs)
    return decoder(batch.input_ids, batch.positions, PackedAttention(batch.cu_seqlens))  # [T, H]


def _sequences():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 96, (n,), generator=gen).tolist() for n in LENGTHS]


def _packed_modules(decoder) -> list[PackedLinear]:
    return [m for m in decoder.modules() if isinstance(m, PackedLinear)]


def _unfused_attention_forward(self, x, positions, rope, attn):
    """SelfAttention.forward before PackedLinear: three GEMMs, contiguous q/k/v."""
    t = x.shape[0]
    q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
    k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, k, positions, rope.get(x.device))  # rope: the model's RotaryCache
    out = attn.attend(self.layer_idx, q, k, v, self.scale)
    return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


def _unfused_mlp_forward(self, x):
    """MLP.forward before PackedLinear: two GEMMs, then a cat."""
    return self.down_proj(silu_and_mul(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)))


class _CatSpy:
    """Counts torch.cat calls that stack parameters (the unpacked PackedLinear path)."""

    def __init__(self, monkeypatch):
        self.param_cats = 0
        original = torch.cat

        def cat(tensors, *args, **kwargs):
            if any(isinstance(t, torch.nn.Parameter) for t in tensors):
                self.param_cats += 1
            return original(tensors, *args, **kwargs)

        monkeypatch.setattr(torch, "cat", cat)


# ---------------------------------------------------------------- the module alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 5, 123])
def test_fused_output_equals_parts(dtype, bias, m):
    gen = torch.Generator().manual_seed(m)
    k, sizes = 129, [5, 127, 64]
    parts = [Linear(k, n, bias) for n in sizes]
    for p in parts:
        for t in p.parameters():
            t.data = torch.randn(t.shape, generator=gen).to(dtype)
    fused = PackedLinear(parts)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = fused(x)
    assert y.shape == (m, sum(sizes)) and y.dtype == dtype
    for got, p in zip(y.split(fused.sizes, -1), parts):
        assert torch.equal(got, linear(x, p.weight, p.bias))
        assert torch.equal(got, p(x))
    fused.pack()
    with torch.no_grad():
        assert torch.equal(fused(x), y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_gradients_reach_each_part(dtype, packed):
    """Weight gradients equal those of separate calls (row n of dW = dY^T X reduces over M only, and
    the fp32 matmul here blocks M the same way for any N). The bias gradient (a column sum of dY,
    vectorised across N) and dX (one [M, N] @ [N, K] fp32 product instead of per-part products summed
    by autograd in the input dtype) agree to rounding only; backward need not be bitwise (rule 7)."""
    gen = torch.Generator().manual_seed(1)
    k, sizes, m = 40, [24, 8, 8], 37
    parts = [Linear(k, n, True) for n in sizes]
    for p in parts:
        for t in p.parameters():
            t.data = torch.randn(t.shape, generator=gen).to(dtype)
    fused = PackedLinear(parts)
    if packed:  # a call that needs a gradient takes the cat path even when packed
        fused.pack()
    x = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(m, sum(sizes), generator=gen).to(dtype)

    (fused(x).float() * g.float()).sum().backward()
    got = [(p.weight.grad, p.bias.grad) for p in parts]
    got_x = x.grad
    for p in parts:
        p.weight.grad = p.bias.grad = None
    x.grad = None
    separate = torch.cat([linear(x, p.weight, p.bias) for p in parts], -1)
    (separate.float() * g.float()).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for (gw, gb), p in zip(got, parts):
        assert gw is not None and gb is not None
        assert torch.equal(gw, p.weight.grad) and bool(gw.abs().sum() > 0)
        torch.testing.assert_close(gb, p.bias.grad, rtol=tol, atol=tol)
    w_cat = torch.cat([p.weight.detach() for p in parts])
    assert torch.equal(got_x, (g.float() @ w_cat.float()).to(dtype))
    torch.testing.assert_close(got_x.float(), x.grad.float(), rtol=tol, atol=tol * g.abs().max().item())


def test_parts_must_agree_on_bias():
    with pytest.raises(ValueError, match="bias"):
        PackedLinear([Linear(4, 2, True), Linear(4, 2, False)])


# ---------------------------------------------------------------- names and keys


def test_state_dict_keys_and_shapes_unchanged(load_model):
    for name, decoder in _decoders(load_model, torch.float32):
        expected = _expected_keys(decoder.config)
        assert _listing(decoder.state_dict().items()) == expected, name
        assert _listing(decoder.named_parameters()) == expected, name
        assert not list(decoder.buffers()), name
        modules = dict(decoder.named_modules())
        assert isinstance(modules["layers.0.self_attn.qkv_proj"], PackedLinear)
        assert isinstance(modules["layers.1.mlp.gate_up_proj"], PackedLinear)
        pack_projections(decoder)
        assert _listing(decoder.state_dict().items()) == expected, name
        assert _listing(decoder.named_parameters()) == expected, name
        assert not list(decoder.buffers()), name


def test_hf_model_names_unchanged_when_packed(load_model):
    """The full training model (lm_head included) keeps the stock Hugging Face key list."""
    for arch in ARCHS:
        model = load_model(arch, torch.float32, True)
        before = _listing(model.state_dict().items())
        assert "model.layers.0.self_attn.k_proj.weight" in dict(before)
        pack_projections(model)
        assert _listing(model.state_dict().items()) == before
        assert not any("qkv_proj" in k or "gate_up_proj" in k for k, _ in before)


# ---------------------------------------------------------------- the whole model


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_equals_three_gemm_model(load_model, monkeypatch, dtype):
    """The fused model (strided q/k/v views through q/k norm, RoPE and attention) gives the bits of
    the unfused model with separate GEMMs and contiguous q/k/v; so does its packed form."""
    seqs = _sequences()
    for name, decoder in _decoders(load_model, dtype):
        with torch.no_grad():
            fused = _hidden(decoder, seqs)
            with monkeypatch.context() as mp:
                mp.setattr(SelfAttention, "forward", _unfused_attention_forward)
                mp.setattr(MLP, "forward", _unfused_mlp_forward)
                unfused = _hidden(decoder, seqs)
            pack_projections(decoder)
            packed = _hidden(decoder, seqs)
        assert bool(torch.isfinite(fused).all()) and bool(fused.abs().sum() > 0), name
        assert torch.equal(fused, unfused), name
        assert torch.equal(packed, unfused), name


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_model_gradients_close_to_three_gemm_model(load_model, monkeypatch, arch):
    """Training through the strided views: every parameter gets a gradient, and it agrees with the
    unfused model's to fp32 rounding (the dX sums differ in order, so not bitwise)."""
    seqs = _sequences()
    decoder = load_model(arch, torch.float32, True).model
    grads = {}
    for label in ("fused", "unfused"):
        decoder.zero_grad(set_to_none=True)
        with monkeypatch.context() as mp:
            if label == "unfused":
                mp.setattr(SelfAttention, "forward", _unfused_attention_forward)
                mp.setattr(MLP, "forward", _unfused_mlp_forward)
            _hidden(decoder, seqs).float().square().mean().backward()
        grads[label] = {n: p.grad.clone() for n, p in decoder.named_parameters() if p.grad is not None}
    assert grads["fused"].keys() == grads["unfused"].keys() == dict(decoder.named_parameters()).keys()
    for n, g in grads["fused"].items():
        ref = grads["unfused"][n]
        assert bool(torch.isfinite(g).all()), n
        torch.testing.assert_close(g, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item() + 1e-12, msg=n)


# ---------------------------------------------------------------- packing


def test_pack_makes_parts_views_of_one_tensor(load_model):
    for name, decoder in _decoders(load_model, torch.bfloat16):
        values = {k: v.clone() for k, v in decoder.state_dict().items()}
        pack_projections(decoder)
        for module in _packed_modules(decoder):
            assert module.is_packed
            weight, bias = module.packed
            assert weight.shape == (sum(module.sizes), module.parts[0].weight.shape[1])
            assert weight.dtype == module.parts[0].weight.dtype
            assert (bias is None) == (module.parts[0].bias is None)
            start = 0
            for part, rows in zip(module.parts, module.sizes):
                assert isinstance(part.weight, torch.nn.Parameter)
                assert part.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
                assert part.weight.data_ptr() == weight[start].data_ptr()
                assert torch.equal(weight[start : start + rows], part.weight)
                if bias is not None:
                    assert part.bias.data_ptr() == bias[start].data_ptr()
                start += rows
        # packing copied the values in: nothing changed
        after = decoder.state_dict()
        assert all(torch.equal(after[k], v) for k, v in values.items()), name
        # idempotent: a second call keeps the same tensors
        held = [m.packed for m in _packed_modules(decoder)]
        pack_projections(decoder)
        assert all(m.packed is h for m, h in zip(_packed_modules(decoder), held)), name


def test_packed_forward_uses_no_cat(load_model, monkeypatch):
    decoder = load_model("qwen2", torch.bfloat16, True).model
    seqs = _sequences()[:1]
    spy = _CatSpy(monkeypatch)
    with torch.no_grad():
        _hidden(decoder, seqs)
        unpacked_cats = spy.param_cats
        pack_projections(decoder)
        spy.param_cats = 0
        _hidden(decoder, seqs)
    assert unpacked_cats == 3 * decoder.config.num_layers  # qkv weight and bias, gate_up weight
    assert spy.param_cats == 0


@pytest.mark.parametrize("write", ["copy_", "load_state_dict", "data.uniform_"])
def test_in_place_writes_reach_the_packed_forward(load_model, write):
    """Weights written into a packed model after packing (as load_weights, RL weight sync and vLLM's
    dummy loader do) give the forward of an unpacked model holding the same weights."""
    seqs = _sequences()
    for name, decoder in _decoders(load_model, torch.bfloat16):
        reference = copy.deepcopy(decoder)  # unpacked
        pack_projections(decoder)
        with torch.no_grad():
            before = _hidden(decoder, seqs)
        gen = torch.Generator().manual_seed(11)
        projections = [n for n, _ in decoder.named_parameters() if "_proj." in n and "o_proj" not in n]
        params = dict(decoder.named_parameters())
        new = {n: (torch.randn(params[n].shape, generator=gen) * 0.05).to(params[n].dtype) for n in projections}
        with torch.no_grad():
            if write == "copy_":
                for n, t in new.items():
                    params[n].copy_(t)
            elif write == "load_state_dict":
                decoder.load_state_dict(new, strict=False)
            else:
                for n in projections:
                    torch.manual_seed(len(n))
                    params[n].data.uniform_(-0.05, 0.05)
                    new[n] = params[n].detach().clone()
            ref_params = dict(reference.named_parameters())
            for n, t in new.items():
                ref_params[n].copy_(t)
        assert all(m.is_packed for m in _packed_modules(decoder)), name
        for module in _packed_modules(decoder):
            assert torch.equal(module.packed[0], torch.cat([p.weight for p in module.parts]))
        with torch.no_grad():
            got, expected = _hidden(decoder, seqs), _hidden(reference, seqs)
        assert not torch.equal(got, before), name
        assert torch.equal(got, expected), name


def test_replaced_parameter_is_refused_then_repacked(load_model):
    decoder = load_model("qwen3", torch.bfloat16, True).model
    seqs = _sequences()[:1]
    pack_projections(decoder)
    with torch.no_grad():
        expected = _hidden(decoder, seqs)
    attn = decoder.layers[1].self_attn
    attn.k_proj.weight.data = attn.k_proj.weight.data.clone()  # no longer a view of the packed rows
    assert not attn.qkv_proj.is_packed
    with torch.no_grad(), pytest.raises(RuntimeError, match="pack_projections"):
        _hidden(decoder, seqs)
    old = attn.qkv_proj.packed[0]
    pack_projections(decoder)
    assert attn.qkv_proj.is_packed and attn.qkv_proj.packed[0] is not old
    with torch.no_grad():
        assert torch.equal(_hidden(decoder, seqs), expected)


# ---------------------------------------------------------------- the Triton kernels on the views


def _qkv_views(t, hq, hkv, d, dtype, seed):
    """q [T, Hq, D], k, v [T, Hkv, D] as the model makes them: views of one [T, (Hq + 2 Hkv) D] tensor."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = y.split([hq * d, hkv * d, hkv * d], -1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def test_triton_attention_accepts_strided_views(interpreted_attention):
    """The GPU attention kernels (through the interpreter) give the same bits for the model's strided
    q/k/v views as for contiguous copies: varlen forward and backward, and the KV-cache write."""
    tk = interpreted_attention
    hq, hkv, d = 4, 2, 16
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    q, k, v = _qkv_views(9, hq, hkv, d, torch.float32, seed=5)
    assert not v.is_contiguous() and v.stride(0) == (hq + 2 * hkv) * d
    grad = torch.randn(9, hq, d, generator=torch.Generator().manual_seed(6))
    results = []
    for qq, kk, vv in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        leaves = [t.detach().requires_grad_() for t in (qq, kk, vv)]
        out = tk.varlen_attention(*leaves, cu, d**-0.5)
        out.backward(grad)
        results.append([out.detach(), *[leaf.grad for leaf in leaves]])
    for got, expected in zip(*results):
        assert torch.equal(got, expected)
    assert bool(results[0][0].abs().sum() > 0) and bool(results[0][3].abs().sum() > 0)

    slots = torch.tensor([5, 0, 7, 2, 3, -1, 9, 10, 1])
    caches = []
    for kk, vv in ((k, v), (k.contiguous(), v.contiguous())):
        k_cache, v_cache = torch.zeros(3, 4, hkv, d), torch.zeros(3, 4, hkv, d)
        tk.write_kv_cache(kk, vv, k_cache, v_cache, slots)
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[0][1].reshape(-1, hkv, d)[9], v[6])


def test_torch_attention_accepts_strided_views():
    """The CPU reference path: the same bits for strided views and contiguous copies."""
    q, k, v = _qkv_views(70, 4, 2, 8, torch.bfloat16, seed=8)
    cu = torch.tensor([0, 5, 70], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, 8**-0.5)
    assert torch.equal(out, varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, 8**-0.5))
    k_cache, v_cache = torch.zeros(2, 64, 2, 8, dtype=torch.bfloat16), torch.zeros(2, 64, 2, 8, dtype=torch.bfloat16)
    write_kv_cache(k, v, k_cache, v_cache, torch.arange(70))
    assert torch.equal(v_cache.reshape(-1, 2, 8)[:70], v) and torch.equal(k_cache.reshape(-1, 2, 8)[:70], k)


# ---------------------------------------------------------------- what the backward keeps


def _cat_forward(self, x):
    """PackedLinear.forward's training path before the saved-tensor fix: autograd through torch.cat,
    so the GEMM saves the stacked [N, K] weight (a copy) for its backward."""
    weight = torch.cat([p.weight for p in self.parts])
    bias = torch.cat([p.bias for p in self.parts]) if self.parts[0].bias is not None else None
    return linear(x, weight, bias)


def _saved_bytes(fn, exclude) -> tuple[int, list[tuple[int, ...]], torch.Tensor]:
    """(bytes of the distinct storages autograd saves while `fn()` runs, other than those of the
    `exclude` tensors; the saved shapes; fn's output)."""
    storages, shapes = {}, []

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    return sum(n for ptr, n in storages.items() if ptr not in skip), shapes, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_backward_saves_no_stacked_weight(monkeypatch, dtype, bias):
    """The module alone saves nothing beyond its input and the parts' own parameters; a plain cat
    of the parts would save the stacked weight, N K elements (which is what makes this measurement meaningful)."""
    gen = torch.Generator().manual_seed(4)
    k, sizes, m = 33, [16, 8, 8], 7
    parts = [Linear(k, n, bias) for n in sizes]
    for p in parts:
        for t in p.parameters():
            t.data = torch.randn(t.shape, generator=gen).to(dtype)
    fused = PackedLinear(parts)
    x = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
    params = [x, *fused._params()]
    extra, shapes, y = _saved_bytes(lambda: fused(x), params)
    assert extra == 0 and (sum(sizes), k) not in shapes
    with monkeypatch.context() as mp:
        mp.setattr(PackedLinear, "forward", _cat_forward)
        old_extra, old_shapes, old_y = _saved_bytes(lambda: fused(x), params)
    assert old_extra == sum(sizes) * k * x.element_size() and (sum(sizes), k) in old_shapes
    assert torch.equal(y, old_y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_saves_less_and_trains_like_the_cat_path(load_model, monkeypatch, dtype):
    """Whole decoders: the saved activations shrink by exactly the stacked q/k/v and gate/up weights
    of every layer, the forward bits are the cat path's, and so are the gradients of every parameter
    (on CPU both backwards are the same fp32 matmuls on the same stacked weight)."""
    seqs = _sequences()
    for name, decoder in _decoders(load_model, dtype):
        params = list(decoder.parameters())
        runs = {}
        for label in ("parts", "cat"):
            decoder.zero_grad(set_to_none=True)
            with monkeypatch.context() as mp:
                if label == "cat":
                    mp.setattr(PackedLinear, "forward", _cat_forward)
                extra, _, hidden = _saved_bytes(lambda d=decoder: _hidden(d, seqs), params)
                hidden.float().square().mean().backward()
            grads = {n: p.grad.clone() for n, p in decoder.named_parameters()}
            runs[label] = (extra, hidden.detach(), grads)
        stacked = sum(sum(m.sizes) * m.parts[0].weight[0].numel() for m in _packed_modules(decoder))
        assert runs["cat"][0] - runs["parts"][0] == stacked * params[0].element_size(), name
        assert torch.equal(runs["parts"][1], runs["cat"][1]), name
        assert runs["parts"][2].keys() == dict(decoder.named_parameters()).keys(), name
        for n, g in runs["parts"][2].items():
            assert torch.equal(g, runs["cat"][2][n]), f"{name}: {n}"
        assert bool(runs["parts"][2]["layers.0.self_attn.k_proj.weight"].abs().sum() > 0), name
