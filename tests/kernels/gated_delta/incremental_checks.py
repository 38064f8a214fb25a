"""Checks of design C of the gated delta rule (kernels/gated_delta/incremental*.py), shared by its torch-path,
interpreter and CUDA tests: random cases, a schedule driver over the IncrementalCache, the decode ==
prefill == training checks, the float64 references of the outputs and the boundary states, and the
gradient check.

`forward(**inputs, initial_state=None) -> (o, states)` is the training op (states: after each sequence's
last full chunk); `cached(q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache, slots, has_state, context_lens)
-> o` the inference op. The chunk is `incremental_cache.CHUNK` (tests shrink it). The caches are paged as
vLLM's hybrid cache binds them (`paged_cache`: one page per slot, each tensor at the page stride).
"""

from __future__ import annotations

import dataclasses
import random

import torch
from gated_delta_reference import (
    GDN_ROWS,
    cache_slots,
    first_difference,
    gdn_inputs,
    gdn_reference,
    packed_cu,
)

from vexact_vllm.kernels.gated_delta import incremental_cache as layout

NAMES = ("q", "k", "v", "a", "b", "A_log", "dt_bias")


def random_case(seed: int, dtype, hk: int | None = None, device="cpu") -> tuple[dict, torch.Tensor]:
    """(inputs, boundary states [N, HV, DV, DK]) of a seeded case: 3-4 sequences of 1 to 2 chunks and a
    few rows (one of exactly a chunk, one of a single row), HK in {1, 2} (or hk), HV = 2 HK, DK, DV in
    {16, 32}; every other sequence starts from a random boundary state, the others from 0."""
    rng = random.Random(seed)
    chunk = layout.CHUNK
    lengths = [rng.randint(2, 2 * chunk + 3) for _ in range(rng.randint(1, 2))] + [chunk, 1]
    rng.shuffle(lengths)
    hk = hk or rng.choice([1, 2])
    dk, dv = rng.choice([16, 32]), rng.choice([16, 32])
    inputs = gdn_inputs(lengths, hk, 2 * hk, dk, dv, dtype=dtype, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed + 100)
    h0 = torch.randn(len(lengths), 2 * hk, dv, dk, generator=gen) * 0.3
    h0[1::2] = 0.0
    return inputs, h0.to(device)


def reference(inputs: dict, h0: torch.Tensor | None = None, beta_rounding=None):
    """float64 (o, states after each sequence's last full chunk) of the recurrence (gdn_reference)."""
    cpu = {name: t.cpu() for name, t in inputs.items()}
    h0 = None if h0 is None else h0.cpu()
    o, _ = gdn_reference(**cpu, initial_state=h0, beta_rounding=beta_rounding)
    cu = cpu["cu_seqlens"].tolist()
    cut = [(cu[n + 1] - cu[n]) // layout.CHUNK * layout.CHUNK for n in range(len(cu) - 1)]
    rows = torch.cat([torch.arange(cu[n], cu[n] + cut[n]) for n in range(len(cut))]).long()
    part = {name: cpu[name][rows] for name in GDN_ROWS}
    _, states = gdn_reference(**part, A_log=cpu["A_log"], dt_bias=cpu["dt_bias"], cu_seqlens=packed_cu(cut),
                              initial_state=h0, beta_rounding=beta_rounding)  # fmt: skip
    return o, states


def run_steps(
    cached, inputs: dict, steps: list, slots: list[int], cache, started: list[bool], decode_only: bool = False
) -> torch.Tensor:
    """Run `cached` over the steps [(seq, rows), ...] (rows of a sequence in order); a sequence continues
    from its slot from its first step if started[seq], else it starts there. decode_only: a step of one
    row a sequence runs as vLLM's decode CUDA graphs run it (`decode_only=True`). Checks after each step that
    the slots' rounded states equal their states rounded. Returns o in packed order."""
    cu = inputs["cu_seqlens"].tolist()
    device = inputs["v"].device
    done = [0] * (len(cu) - 1)
    out = torch.full_like(inputs["v"], float("nan"))
    for step in steps:
        rows = torch.cat([torch.arange(cu[i] + done[i], cu[i] + done[i] + n) for i, n in step]).to(device)
        step_cu = packed_cu([n for _, n in step], device)
        step_slots = torch.tensor([slots[i] for i, _ in step], device=device)
        has_state = torch.tensor([done[i] > 0 or started[i] for i, _ in step], device=device)
        context = torch.tensor([done[i] for i, _ in step], device=device)  # a boundary state: 0 rows held
        rest = {name: inputs[name][rows] for name in GDN_ROWS}
        single = {"decode_only": True} if decode_only and all(n == 1 for _, n in step) else {}
        out[rows] = cached(**rest, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], cu_seqlens=step_cu, cache=cache,
                           slots=step_slots, has_state=has_state, context_lens=context, **single)  # fmt: skip
        rounded = cache.state[step_slots].to(cache.state_dt.dtype)  # the rounded copy follows every state written
        got = cache.state_dt[step_slots]
        assert torch.equal(got, rounded), f"cache.state_dt after {step}: {first_difference(got, rounded)}"
        for i, n in step:
            done[i] += n
    return out


def paged_cache(n_slots: int, hk: int, hv: int, d_k: int, d_v: int, dtype, device) -> layout.IncrementalCache:
    """An IncrementalCache whose tensors share one page per slot (each slot contiguous, the slots at the
    page stride, 16 bytes between tensors), as vLLM's hybrid cache binds a state layer's tensors."""
    one = layout.IncrementalCache.empty(1, hk, hv, d_k, d_v, dtype, "meta")
    sizes = [t[0].numel() * t.element_size() for t in one.tensors()]
    offsets = [16 + sum(-(-s // 16) * 16 + 16 for s in sizes[:i]) for i in range(len(sizes))]
    pages = torch.zeros(n_slots, offsets[-1] + -(-sizes[-1] // 16) * 16 + 16, dtype=torch.uint8, device=device)
    views = [pages[:, o : o + s].view(t.dtype).view(n_slots, *t.shape[1:])
             for t, o, s in zip(one.tensors(), offsets, sizes, strict=True)]  # fmt: skip
    assert all(not t.is_contiguous() for t in views) or n_slots == 1
    return layout.IncrementalCache(*views)


def fresh_cache(inputs: dict, slots: list[int], h0: torch.Tensor | None, spare: int):
    """A paged IncrementalCache holding NaN everywhere (a slot's stale contents must never be read),
    except the boundary states h0 of the sequences that continue (and their rounded copies, the layout's
    invariant): returns (cache, started)."""
    q, v = inputs["q"], inputs["v"]
    cache = paged_cache(len(slots) + spare, q.shape[1], v.shape[1], q.shape[2], v.shape[2], v.dtype, v.device)
    for t in cache.tensors():
        t.fill_(float("nan"))
    started = [h0 is not None and bool(h0[n].abs().sum() > 0) for n in range(len(slots))]
    for n, slot in enumerate(slots):
        if started[n]:
            cache.state[slot] = h0[n]
            cache.state_dt[slot] = h0[n].to(cache.state_dt.dtype)
    return cache, started


def check_schedules(forward, cached, inputs: dict, h0: torch.Tensor | None, seeds=(0, 1), max_chunk=None):
    """Random schedules of decode steps and prefill chunks give the training forward's outputs and
    boundary states bit for bit. Seed 0 decodes every row, each step as vLLM's decode CUDA graphs run
    it (`decode_only`: the decode step alone), through chunk completions and sequences that
    start at a decode step. Returns the training (o, states)."""
    cu = inputs["cu_seqlens"]
    lengths = (cu[1:] - cu[:-1]).tolist()
    with torch.no_grad():
        o, states = forward(**inputs, initial_state=h0)
        slots = cache_slots(len(lengths), 2)
        for seed in seeds:
            cache, started = fresh_cache(inputs, slots, h0, 2)
            steps = random_schedule_c(lengths, seed, max_chunk or 2 * layout.CHUNK, 1.0 if seed == 0 else 0.4)
            got = run_steps(cached, inputs, steps, slots, cache, started, decode_only=seed == 0)
            assert torch.equal(got, o), f"schedule seed {seed}: outputs: {first_difference(got, o)}"
            held = cache.state[torch.tensor(slots, device=o.device)]
            assert torch.equal(held, states), f"schedule seed {seed}: states: {first_difference(held, states)}"
    return o, states


def check_cached_rows(cached, inputs: dict, h0: torch.Tensor | None, p: int) -> None:
    """A prefill of a sequence's first p rows (< CHUNK; the chunk kernels) and p decode steps leave the
    same bits in every per-row tensor of its cache slot and the same outputs; a
    failure names the first tensor that differs (T rows reach o only rounded to the input dtype, so a
    difference there can hide from the outputs)."""
    assert 0 < p < layout.CHUNK
    rows = {name: (t[:p] if name in GDN_ROWS else t) for name, t in inputs.items()}
    rows["cu_seqlens"] = packed_cu([p], inputs["v"].device)
    held, outs = [], []
    for steps in ([[(0, p)]], [[(0, 1)]] * p):
        cache, started = fresh_cache(rows, [0], h0, 1)
        with torch.no_grad():
            outs.append(run_steps(cached, rows, steps, [0], cache, started))
        held.append(cache)
    for name in ("k", "x", "g", "beta", "t", "vnew"):
        a, b = getattr(held[0], name)[0, :p], getattr(held[1], name)[0, :p]
        assert torch.equal(a, b), f"cached {name} after {p} rows: prefill vs decode steps: {first_difference(a, b)}"
    assert torch.equal(outs[0], outs[1]), f"outputs: {first_difference(outs[0], outs[1])}"


def random_schedule_c(lengths: list[int], seed: int, max_chunk: int, decode_share: float) -> list:
    """As gated_delta_reference.random_schedule, prefill chunks up to max_chunk rows."""
    rng = random.Random(seed)
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths)):
        left = [i for i, (d, n) in enumerate(zip(done, lengths)) if d < n]
        rng.shuffle(left)
        step = []
        for i in left[: rng.randint(1, len(left))]:
            rows = min(1 if rng.random() < decode_share else rng.randint(1, max_chunk), lengths[i] - done[i])
            step.append((i, rows))
            done[i] += rows
        steps.append(step)
    return steps


def check_every_row_count(forward, cached, hk, hv, dk, dv, dtype, device="cpu", seed=0):
    """For every p = 0 .. CHUNK - 1, one sequence of CHUNK + 1 rows from a random boundary state: a prefill
    of its first p rows (a partial chunk of p rows), a decode of row p (p rows held), then the rest in
    one step (the chunk kernels start from the p + 1 rows held, complete the chunk and take the next): the training
    forward's bits for every row and the state after the chunk."""
    C = layout.CHUNK
    inputs = gdn_inputs([C + 1] * C, hk, hv, dk, dv, dtype=dtype, seed=seed, device=device)
    h0 = (torch.randn(C, hv, dv, dk, generator=torch.Generator().manual_seed(seed)) * 0.3).to(device)
    with torch.no_grad():
        o, states = forward(**inputs, initial_state=h0)
        slots = list(range(C))
        cache, started = fresh_cache(inputs, slots, h0, 1)
        steps = [[(p, p) for p in range(1, C)], [(p, 1) for p in range(C)], [(p, C - p) for p in range(C)]]
        got = run_steps(cached, inputs, steps, slots, cache, started)
    for p in range(C):
        rows = slice(p * (C + 1), (p + 1) * (C + 1))
        assert torch.equal(got[rows], o[rows]), f"row count {p}: {first_difference(got[rows], o[rows])}"
    assert torch.equal(cache.state[:C], states), f"states: {first_difference(cache.state[:C], states)}"
    return o


def check_gradients(forward, inputs: dict, h0: torch.Tensor, rtol: float) -> None:
    """Gradients of every input and of the initial states, for a loss reading o and the boundary states,
    against float64 autograd of the reference recurrence, relative to each gradient's largest entry."""
    leaves = {n: inputs[n].clone().requires_grad_() for n in NAMES}
    leaves["initial_state"] = h0.clone().requires_grad_()
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(inputs["v"].shape, generator=gen).to(h0.device)
    d_states = torch.randn(h0.shape, generator=gen).to(h0.device)
    o, states = forward(**leaves, cu_seqlens=inputs["cu_seqlens"])
    ((o.float() * do).sum() + (states * d_states).sum()).backward()
    ref = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    rows = {n: ref[n] for n in NAMES}
    want_o, want_states = reference({**rows, "cu_seqlens": inputs["cu_seqlens"]}, ref["initial_state"])
    ((want_o * do.cpu().double()).sum() + (want_states * d_states.cpu().double()).sum()).backward()
    for name, leaf in leaves.items():
        want = ref[name].grad
        err = float((leaf.grad.double().cpu() - want).abs().max() / want.abs().max())
        assert err <= rtol, f"d {name}: largest error {err:.2e} of the largest gradient (tolerance {rtol:.0e})"


def check_padded_requests(cached, device="cpu") -> None:
    """A step whose requests include padded ones (slot -1, no rows: a CUDA graph's padding) gives the
    outputs and leaves the cache bits of the same step without them: after a prefill, a step of one
    decode row, a row completing the partial chunk, a fresh sequence and two padded requests; then the
    same as a graph replays it: decode_only, with two padding rows (random values) past the last
    sequence's end."""
    c = layout.CHUNK
    lengths = [c // 2 + 1, c - 1, 3]
    inputs = gdn_inputs(lengths, 1, 2, 16, 16, seed=9, device=device)
    slots = [1, 3, 0]
    bits = []
    for pad, decode_only in ((0, False), (2, False), (2, True)):
        cache, started = fresh_cache(inputs, slots, None, 2)
        prefill = [[(0, c // 2), (1, c - 2)]]
        out = run_steps(cached, inputs, prefill, slots, cache, started)  # rows held: c / 2 and c - 2
        cu = inputs["cu_seqlens"].tolist()
        rows = torch.tensor([cu[0] + c // 2, cu[1] + c - 2, cu[2]], device=device)
        step = {name: inputs[name][rows] for name in GDN_ROWS}
        if decode_only:  # the graph's padding rows: as many rows as sequences
            g = torch.Generator().manual_seed(pad)
            step = {name: torch.cat([t, torch.randn((pad, *t.shape[1:]), generator=g).to(t)])
                    for name, t in step.items()}  # fmt: skip
        with torch.no_grad():
            o = cached(**step, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
                       cu_seqlens=packed_cu([1, 1, 1] + [0] * pad, device), cache=cache,
                       slots=torch.tensor(slots + [-1] * pad, device=device),
                       has_state=torch.tensor([True, True, False] + [False] * pad, device=device),
                       context_lens=torch.tensor([c // 2, c - 2, 0] + [0] * pad, device=device),
                       decode_only=decode_only)  # fmt: skip
        bits.append((torch.cat([out[out == out], o[:3].flatten()]),
                     [t.contiguous().view(torch.uint8) for t in cache.tensors()]))  # fmt: skip
    o0, cache0 = bits[0]
    for (o1, cache1), what in zip(bits[1:], ("padded requests", "a replayed graph's padding rows")):
        assert torch.equal(o0, o1), f"outputs with {what}: {first_difference(o1, o0)}"
        names = [f.name for f in dataclasses.fields(layout.IncrementalCache)]  # tensors()' order
        for name, a, b in zip(names, cache0, cache1, strict=True):
            assert torch.equal(a, b), f"cache.{name} differs with {what}"
