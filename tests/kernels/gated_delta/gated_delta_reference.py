"""Shared helpers of the Gated DeltaNet kernel tests: seeded inputs, float64 references written from
the formulas (not from the kernels), random step schedules and a driver that runs a cached op over
them, and a message naming the first differing element.

Formulas (transformers' orientation: the state S is [DK, DV]; the kernels store S^T):
    conv:  y = silu(bias + sum_j w[:, j] x[p - (W - 1) + j]),  x before the sequence = 0
    q_hat = q / sqrt(|q|^2 + 1e-6) * d_k^-1/2,  k_hat = k / sqrt(|k|^2 + 1e-6)
    g = -exp(A_log) softplus(a + dt_bias),  beta = sigmoid(b) rounded to b's dtype
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,  o_t = S_t^T q_t
v head h reads k head h // (HV / HK).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F


def packed_cu(lengths: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def gdn_inputs(lengths, hk, hv, dk, dv, dtype=torch.float32, seed=0, device="cpu") -> dict:
    """q, k [T, HK, DK], v [T, HV, DV], a, b [T, HV] in `dtype`; A_log, dt_bias [HV] fp32 (log of
    decay rates in [0.01, 2]: some heads remember long, some forget fast); cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    t = {
        "q": torch.randn(n, hk, dk, generator=g),
        "k": torch.randn(n, hk, dk, generator=g),
        "v": torch.randn(n, hv, dv, generator=g),
        "a": torch.randn(n, hv, generator=g),
        "b": torch.randn(n, hv, generator=g) * 2,
    }
    out = {name: x.to(dtype).to(device) for name, x in t.items()}
    out["A_log"] = torch.log(torch.rand(hv, generator=g) * 1.99 + 0.01).to(device)
    out["dt_bias"] = (torch.randn(hv, generator=g) * 0.5).to(device)
    out["cu_seqlens"] = packed_cu(lengths, device)
    return out


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 toward zero, as the Triton interpreter converts fp32 to bf16 (the GPU and
    torch round to nearest even)."""
    bits = x.float().view(torch.int32) & -65536
    return bits.view(torch.float32).double()


def gdn_reference(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state=None, beta_rounding=None):
    """float64 (o [T, HV, DV], final states [N, HV, DV, DK]) from the formulas, one sequence and one
    token at a time; initial_state in the kernels' [N, HV, DV, DK] layout. beta_rounding: how beta
    is rounded to b's dtype (default: to nearest, as torch and the GPU)."""
    hk, d_k = q.shape[1], q.shape[2]
    hv = v.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d_k**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    heads = torch.arange(hv) // (hv // hk)
    q, k = q[:, heads], k[:, heads]  # [T, HV, DK]
    g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    beta = torch.sigmoid(b.double())
    beta = (
        beta.to(b.dtype).double()
        if beta_rounding is None or b.dtype != torch.bfloat16
        else beta_rounding(beta)
    )
    cu = cu_seqlens.tolist()
    o = torch.zeros(v.shape, dtype=torch.float64)
    finals = []
    for n in range(len(cu) - 1):
        s = torch.zeros(hv, d_k, v.shape[2], dtype=torch.float64)  # [HV, DK, DV]
        if initial_state is not None:
            s = initial_state[n].double().transpose(-1, -2).clone()
        for t in range(cu[n], cu[n + 1]):
            s = s * g[t].exp()[:, None, None]
            u = v[t] - torch.einsum("hkv,hk->hv", s, k[t])
            s = s + k[t][:, :, None] * (beta[t][:, None] * u)[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", s, q[t])
        finals.append(s.transpose(-1, -2))
    return o, torch.stack(finals)


def conv_reference(x, weight, bias, cu_seqlens):
    """float64 SiLU(causal depthwise conv) of packed sequences (zeros before each start)."""
    cu = cu_seqlens.tolist()
    width = weight.shape[1]
    outs = []
    for n in range(len(cu) - 1):
        seq = x[cu[n] : cu[n + 1]].double().T[None]  # [1, C, L]
        y = F.conv1d(F.pad(seq, (width - 1, 0)), weight.double()[:, None], None if bias is None else bias.double(),
                     groups=x.shape[1])  # fmt: skip
        outs.append(F.silu(y)[0].T)
    return torch.cat(outs)


def conv_inputs(lengths, channels, width, dtype, bias=True, seed=0):
    """x [T, C], weight [C, W], bias [C] or None, cu_seqlens (seeded)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), channels, generator=g).to(dtype)
    w = (torch.randn(channels, width, generator=g) * 0.5).to(dtype)
    b = (torch.randn(channels, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, b, packed_cu(lengths)


def cache_slots(n: int, spare: int) -> list[int]:
    """n distinct cache slots out of n + spare, in a shuffled order (seeded by n): sequence i owns
    slot i's entry alone, as vLLM gives each running request its own slot."""
    slots = random.Random(n).sample(range(n + spare), n)
    assert len(set(slots)) == n
    return slots


def check_conv_schedules(conv, x, w, b, cu, seeds=(0, 1, 2)):
    """Every random schedule of decode and prefill steps gives the training call's bits, and leaves
    each slot holding its sequence's W - 1 last inputs (zeros before its start). Returns the
    training call's output."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    full = conv(x, w, b, cu)
    width = w.shape[1]
    slots = cache_slots(len(lengths), 2)
    for seed in seeds:
        state = torch.full((len(lengths) + 2, width - 1, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
        steps = random_schedule(lengths, seed, max_chunk=5)
        got = run_schedule(
            lambda rows, step_cu, s, h, state=state: conv(rows, w, b, step_cu, state, s, h),
            {"x": x, "cu_seqlens": cu}, ("x",),
            steps, slots,
        )  # fmt: skip
        assert torch.equal(got, full), f"schedule seed {seed}: {first_difference(got, full)}"
        zeros = torch.zeros(width - 1, x.shape[1], dtype=x.dtype, device=x.device)
        for n, slot in enumerate(slots):
            seq = torch.cat([zeros, x[cu[n] : cu[n + 1]]])
            assert torch.equal(state[slot], seq[-(width - 1) :]), (
                f"schedule seed {seed}: slot of sequence {n}"
            )
    return full


def random_schedule(lengths: list[int], seed: int, max_chunk: int = 7, decode_share: float = 0.5) -> list:
    """Steps [(seq, rows), ...] that consume every sequence: each step takes a random subset of the
    unfinished sequences (in a random order), each with 1 row (a decode) or a random chunk."""
    rng = random.Random(seed)
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths)):
        left = [i for i, (d, n) in enumerate(zip(done, lengths)) if d < n]
        rng.shuffle(left)
        step = []
        for i in left[: rng.randint(1, len(left))]:
            rows = 1 if rng.random() < decode_share else rng.randint(1, max_chunk)
            rows = min(rows, lengths[i] - done[i])
            step.append((i, rows))
            done[i] += rows
        steps.append(step)
    return steps


def run_schedule(step_fn, inputs: dict, names: tuple, steps: list, slots: list[int]):
    """Run `step_fn(*rows of names, cu_seqlens, slots, has_state)` over the steps; returns the
    outputs reassembled in packed order ([T, ...])."""
    cu = inputs["cu_seqlens"].tolist()
    device = inputs[names[0]].device
    done = [0] * (len(cu) - 1)
    out = [None] * cu[-1]
    for step in steps:
        rows = torch.cat([torch.arange(cu[i] + done[i], cu[i] + done[i] + n) for i, n in step]).to(device)
        sizes = [n for _, n in step]
        step_cu = packed_cu(sizes, device)
        step_slots = torch.tensor([slots[i] for i, _ in step], device=device)
        has_state = torch.tensor([done[i] > 0 for i, _ in step], device=device)
        y = step_fn(*(inputs[name][rows] for name in names), step_cu, step_slots, has_state)
        for row, value in zip(rows.tolist(), y):
            out[row] = value
        for i, n in step:
            done[i] += n
    return torch.stack(out)


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when equal, else the first differing element: index and both values (and their bits)."""
    if got.shape != want.shape:
        return f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
    diff = (got != want) & ~(got.isnan() & want.isnan())
    if not bool(diff.any()):
        return ""
    idx = tuple(int(i) for i in diff.nonzero()[0])
    a, b = got[idx].item(), want[idx].item()
    count = int(diff.sum())
    return f"{count} of {got.numel()} elements differ; first at {idx}: {a!r} vs {b!r} (diff {a - b:.3e})"


GDN_ROWS = ("q", "k", "v", "a", "b")


def check_gdn_schedules(forward, cached, inputs: dict, seeds=(0, 1, 2)):
    """`cached` (the inference op) over random schedules of decode and prefill steps (one seed
    decodes only, the others mix) gives the bits of `forward` (the training op) on the packed
    sequences: outputs and the states left in the slots. Returns the training (o, final states)."""
    cu = inputs["cu_seqlens"]
    lengths = (cu[1:] - cu[:-1]).tolist()
    o, final = forward(**inputs)
    v, k = inputs["v"], inputs["k"]
    slots = cache_slots(len(lengths), 3)
    for seed in seeds:
        cache = torch.full(
            (len(lengths) + 3, v.shape[1], v.shape[2], k.shape[2]), float("nan"), device=v.device
        )
        steps = random_schedule(lengths, seed, decode_share=1.0 if seed == 0 else 0.5)

        def step(q, k, v, a, b, step_cu, step_slots, has_state, cache=cache):
            return cached(
                q, k, v, a, b, inputs["A_log"], inputs["dt_bias"], step_cu, cache, step_slots, has_state
            )

        got = run_schedule(step, inputs, GDN_ROWS, steps, slots)
        assert torch.equal(got, o), f"schedule seed {seed}: outputs: {first_difference(got, o)}"
        states = cache[torch.tensor(slots, device=v.device)]
        assert torch.equal(states, final), f"schedule seed {seed}: states: {first_difference(states, final)}"
    return o, final


def check_continuation(forward, inputs: dict, seed: int = 0):
    """Training each sequence in two parts, the second from the first's final state, gives the bits
    of one pass (prefill from a cached state through the training entry point)."""
    cu = inputs["cu_seqlens"].tolist()
    rng = random.Random(seed)
    o, final = forward(**inputs)
    cuts = [rng.randint(cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    first = torch.cat([torch.arange(cu[n], cuts[n]) for n in range(len(cu) - 1)])
    second = torch.cat([torch.arange(cuts[n], cu[n + 1]) for n in range(len(cu) - 1)])
    device = inputs["v"].device
    part = {name: inputs[name] for name in ("A_log", "dt_bias")}
    part1 = {**part, **{name: inputs[name][first.to(device)] for name in GDN_ROWS}}
    part1["cu_seqlens"] = packed_cu([cuts[n] - cu[n] for n in range(len(cu) - 1)], device)
    o1, mid = forward(**part1)
    part2 = {**part, **{name: inputs[name][second.to(device)] for name in GDN_ROWS}}
    part2["cu_seqlens"] = packed_cu([cu[n + 1] - cuts[n] for n in range(len(cu) - 1)], device)
    o2, end = forward(**part2, initial_state=mid)
    got = torch.empty_like(o)
    got[first.to(device)], got[second.to(device)] = o1, o2
    assert torch.equal(got, o), f"continuation: outputs: {first_difference(got, o)}"
    assert torch.equal(end, final), f"continuation: states: {first_difference(end, final)}"
