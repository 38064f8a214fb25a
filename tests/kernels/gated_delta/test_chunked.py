"""Candidate design B, the chunk-anchored gated delta rule: its training forward against the float64
reference, and decode / prefill steps (the partial chunk recomputed from the boundary state by the
training kernel, zero-padded) against the training forward, bit for bit.

Under the interpreter (CPU, chunks of 16, v tiles of 16) the products are numpy's and the equality is
proven here. The CUDA tests are the experiment that decides the design's open question on a GPU: do
zero-padded future rows leave a chunk's earlier rows unchanged through the tensor-core products? Two
forms: every row count p of one chunk from a boundary state against the full chunk (the direct
question), and random decode / prefill schedules against training at Qwen3-Next / Qwen3.5 heads. A
pass proves it for that GPU, dtype and shape; a failure names the first differing element.
"""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import
sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (importlib import mode)

from gated_delta_reference import (  # noqa: E402
    GDN_ROWS,
    cache_slots,
    first_difference,
    gdn_inputs,
    gdn_reference,
    random_schedule,
    run_schedule,
    truncate_to_bf16,
)

MODULES = ("vexact_vllm.kernels.gated_delta.chunked_triton", "vexact_vllm.kernels.gated_delta.chunked")
LENGTHS = [37, 1, 16, 17, 9]  # several chunks, exactly one, one plus a row, a partial one
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def modules(interpreted_modules):
    return interpreted_modules(MODULES)


@pytest.fixture
def chunked(modules, monkeypatch):
    """The interpreted op module, with chunks of 16 rows (the interpreter's products are slow) and v
    tiles of 16 columns (several tiles a head, the last one masked at DV 24 or 40)."""
    launcher, op = modules
    monkeypatch.setattr(launcher, "CHUNK", 16)
    monkeypatch.setattr(launcher, "BLOCK_V", 16)
    return op


def boundary_states(op, inputs):
    """The training kernel's state after each sequence's last full chunk ([N, HV, DV, DK]; NaN for
    sequences shorter than a chunk)."""
    n = inputs["cu_seqlens"].shape[0] - 1
    v, k = inputs["v"], inputs["k"]
    states = torch.full((n, v.shape[1], v.shape[2], k.shape[2]), float("nan"), device=v.device)
    ids = torch.arange(n, device=v.device)
    rows = {name: inputs[name] for name in (*GDN_ROWS, "A_log", "dt_bias", "cu_seqlens")}
    op.kernels.chunked_forward(*rows.values(), states, torch.full_like(ids, -1), states, ids)
    return states


def check_steps_match_training(op, inputs, seeds):
    """Every random schedule of chunk-anchored steps gives the training forward's bits: the outputs,
    the boundary states committed to the cache and the partial chunks' rows."""
    cu = inputs["cu_seqlens"]
    lengths = (cu[1:] - cu[:-1]).tolist()
    with torch.no_grad():
        want = op.chunked_gated_delta_rule(**inputs)
        want_states = boundary_states(op, inputs)
    v, k = inputs["v"], inputs["k"]
    slots = cache_slots(len(lengths), 2)
    chunk = op.kernels.CHUNK
    for seed in seeds:
        cache = op.ChunkAnchoredCache.empty(len(lengths) + 2, k.shape[1], v.shape[1], k.shape[2], v.shape[2],
                                            v.dtype, v.device)  # fmt: skip
        for t in (cache.state, cache.q, cache.k, cache.v, cache.a, cache.b):
            t.fill_(float("nan"))  # a slot's stale contents must never be read

        def step(q, k, v, a, b, step_cu, step_slots, has_state, cache=cache):
            return op.chunk_anchored_step(q, k, v, a, b, inputs["A_log"], inputs["dt_bias"], step_cu, cache,
                                          step_slots, has_state)  # fmt: skip

        steps = random_schedule(lengths, seed, max_chunk=2 * chunk, decode_share=1.0 if seed == 0 else 0.5)
        got = run_schedule(step, inputs, GDN_ROWS, steps, slots)
        assert torch.equal(got, want), f"schedule seed {seed}: outputs: {first_difference(got, want)}"
        for n, slot in enumerate(slots):
            tail = lengths[n] % chunk
            assert int(cache.rows[slot]) == tail
            end = int(cu[n + 1])
            assert torch.equal(cache.v[slot, :tail], v[end - tail : end]), f"sequence {n}: partial rows"
            if lengths[n] >= chunk:
                state = cache.state[slot]
                assert torch.equal(state, want_states[n]), f"seed {seed}, sequence {n}: boundary state: " + (
                    first_difference(state, want_states[n])
                )
    return want


def check_zero_padding(op, inputs):
    """Every sequence of `inputs` holds exactly one chunk. For each row count p = 1..CHUNK, the training
    kernel on each sequence's first p rows (the chunk's later rows masked to zero in the kernel), from a
    non-zero boundary state, must give those rows the bits they have when the whole chunk runs."""
    cu = inputs["cu_seqlens"]
    n_seqs = cu.shape[0] - 1
    chunk = op.kernels.CHUNK
    assert torch.equal(cu.cpu(), torch.arange(n_seqs + 1, dtype=cu.dtype) * chunk)
    v, k = inputs["v"], inputs["k"]
    gen = torch.Generator().manual_seed(7)
    h0 = (torch.randn(n_seqs, v.shape[1], v.shape[2], k.shape[2], generator=gen) * 0.3).to(v.device)
    ids = torch.arange(n_seqs, device=v.device)
    none = torch.full_like(ids, -1)
    params = (inputs["A_log"], inputs["dt_bias"])

    def run(rows, step_cu):
        inputs_rows = [inputs[name][rows] for name in GDN_ROWS]
        return op.kernels.chunked_forward(*inputs_rows, *params, step_cu, h0, ids, h0, none)

    with torch.no_grad():
        full = run(torch.arange(n_seqs * chunk, device=v.device), cu)
        failures = []
        for p in range(1, chunk + 1):
            rows = (ids[:, None] * chunk + torch.arange(p, device=v.device)[None, :]).reshape(-1)
            step_cu = (torch.arange(n_seqs + 1, device=v.device) * p).to(cu.dtype)
            diff = first_difference(run(rows, step_cu), full[rows])
            if diff:
                failures.append(f"rows 0..{p - 1} alone (rows [packed {n_seqs} x {p}, HV, DV]): {diff}")
    assert not failures, f"{len(failures)} of {chunk} row counts differ; first: {failures[0]}"


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_forward_accuracy(chunked, dtype):
    inputs = gdn_inputs(LENGTHS, 2, 4, 16, 8, dtype=dtype)
    with torch.no_grad():
        o = chunked.chunked_gated_delta_rule(**inputs)
    rounding = truncate_to_bf16 if dtype == torch.bfloat16 else None  # the interpreter truncates to bf16
    want, _ = gdn_reference(**inputs, beta_rounding=rounding)
    # bf16: q_hat, k_hat, the solve and the state round to bf16 as dot operands (as fla's chunked kernels)
    tol = 1e-6 if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(o.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "dtype,shape", [(F32, (2, 4, 16, 24)), (BF16, (1, 2, 24, 24))], ids=["f32-dk16", "bf16-dk24"]
)
def test_steps_match_training_bitwise(chunked, dtype, shape):
    """(HK, HV, DK, DV): DK 24 pads the k block to 32; DV 24 ends in a masked v tile."""
    inputs = gdn_inputs(LENGTHS, *shape, dtype=dtype, seed=1)
    check_steps_match_training(chunked, inputs, seeds=(0,))  # the CUDA test draws more


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_zero_padded_rows_keep_earlier_bits(chunked, dtype):
    inputs = gdn_inputs([16] * 2, 1, 2, 24, 24, dtype=dtype, seed=5)
    check_zero_padding(chunked, inputs)


def test_refuses_gradients(chunked):
    inputs = gdn_inputs([3], 1, 1, 16, 8)
    inputs["q"].requires_grad_()
    with pytest.raises(ValueError, match="no backward"):
        chunked.chunked_gated_delta_rule(**inputs)


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels): the zero-padding experiment
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hk,hv,dtype", [(16, 32, BF16), (16, 48, BF16), (16, 32, F32)], ids=str)
def test_cuda_zero_padded_rows_keep_earlier_bits(hk, hv, dtype):
    """The direct question at chunks of 64, d_k = d_v = 128, Qwen3-Next / Qwen3.5 heads: each of the 64
    row counts of a chunk against the full chunk, from a non-zero boundary state."""
    from vexact_vllm.kernels.gated_delta import chunked

    inputs = gdn_inputs([64] * 3, hk, hv, 128, 128, dtype=dtype, seed=5, device="cuda")
    check_zero_padding(chunked, inputs)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hk,hv,dtype", [(16, 32, BF16), (16, 48, BF16), (2, 4, F32)], ids=str)
def test_cuda_steps_match_training_bitwise(hk, hv, dtype):
    """Chunks of 64 at d_k = d_v = 128 (16 k heads and 32 or 48 v heads in bf16; fp32 at fewer heads):
    every decode step and prefill chunk of random schedules against the training forward. Failing
    names the first differing element: design B does not hold on this GPU with these kernels."""
    from vexact_vllm.kernels.gated_delta import chunked

    inputs = gdn_inputs([200, 1, 64, 65, 127, 130], hk, hv, 128, 128, dtype=dtype, device="cuda")
    want = check_steps_match_training(chunked, inputs, seeds=(0,))  # the CUDA test draws more
    ref, _ = gdn_reference(**{n: t.cpu() for n, t in inputs.items()})
    torch.testing.assert_close(want.double().cpu(), ref, atol=3e-2, rtol=3e-2)
