"""Design C of the gated delta rule on Triton: the interpreter on CPU tensors (chunks of 8 rows in row
tiles of 4, small odd shapes), the compiled kernels on CUDA (chunks of 64, Qwen3-Next / Qwen3.5 heads).

Random schedules of decode steps (the decode step) and prefill chunks (the chunk kernels, from the rows a
slot holds of a partial chunk on) from random boundary states give the packed training
forward's outputs and states bit for bit, every row count of a partial chunk included; the forward
against the float64 recurrence; the chunked backward against its float64 autograd. Under the
interpreter the products are numpy's; on a GPU the tensor-core and FMA dots decide: the CUDA tests are
the proof there (a failure names the first differing element), `benchmarks/inspect_gated_delta.py` the
static check of the compiled code."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import
sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper modules (importlib import mode)

from gated_delta_reference import gdn_inputs, truncate_to_bf16  # noqa: E402
from incremental_checks import (  # noqa: E402
    check_cached_rows,
    check_every_row_count,
    check_gradients,
    check_schedules,
    random_case,
    reference,
)

from vexact_vllm.kernels.gated_delta import incremental_cache as layout  # noqa: E402

PACKAGE = "vexact_vllm.kernels.gated_delta."
MODULES = tuple(PACKAGE + m for m in ("incremental_triton", "incremental_tiles_triton", "incremental_chunk_triton",
                                      "incremental_decode_triton",
                                      "incremental_triton_bwd"))  # fmt: skip
F32, BF16 = torch.float32, torch.bfloat16
# dtype -> tolerance of o against the float64 recurrence (bf16: dot operands rounded to bf16, by
# truncation under the interpreter)
TOL = {F32: 2e-6, BF16: 3e-2}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def modules(interpreted_modules):
    """The interpreted modules. The interpreter patches triton.language again at every call of a
    @triton.jit routine (most of these kernels' interpreted time); the kernel's own patch covers them."""
    interpreter = importlib.import_module("triton.runtime.interpreter")
    original = interpreter.InterpretedFunction.__call__

    def call(self, *args, **kwargs):
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.InterpretedFunction.__call__ = call
    try:
        yield interpreted_modules(MODULES)
    finally:
        interpreter.InterpretedFunction.__call__ = original


@pytest.fixture
def ops(modules, monkeypatch):
    """(training op, cached op) interpreted, with chunks of 8 in row tiles of 4 (two a chunk) and v
    tiles of 32 (one a head; the row-count test takes two)."""
    ops_module, tiles = modules[0], modules[1]
    monkeypatch.setattr(layout, "CHUNK", 8)
    monkeypatch.setattr(tiles, "ROWS", 4)
    monkeypatch.setattr(tiles, "BLOCK_V", 32)
    return ops_module.incremental_gated_delta_rule_triton, ops_module.incremental_gated_delta_rule_cached_triton


def _assert_accurate(o, states, inputs, h0, dtype, interpreted=True):
    rounding = truncate_to_bf16 if interpreted else None  # the interpreter truncates to bf16
    want_o, want_states = reference(inputs, h0, beta_rounding=rounding)
    torch.testing.assert_close(o.double().cpu(), want_o, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(states.double().cpu(), want_states, atol=10 * TOL[dtype], rtol=10 * TOL[dtype])


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,seed,schedules,block_v",
                         [(F32, 0, (0, 1), 32), (BF16, 2, (2,), 16), (BF16, 0, (0,), 16)],
                         ids=["f32-0", "bf16-2", "bf16-0-decode"])  # fmt: skip
def test_schedules_match_training_bitwise(ops, modules, monkeypatch, dtype, seed, schedules, block_v):
    """Schedule seed 0 decodes every row (decode-only steps), the others mix decodes and prefill chunks.
    bf16 at block_v 16 takes two v tiles a head (d_v = 32): the second tile reads the rows (k, g, beta,
    T) the first wrote."""
    monkeypatch.setattr(modules[1], "BLOCK_V", block_v)
    inputs, h0 = random_case(seed, dtype, hk=2)
    o, states = check_schedules(*ops, inputs, h0, seeds=schedules)
    _assert_accurate(o, states, inputs, h0, dtype)


def test_every_row_count_of_a_partial_chunk(ops):
    check_every_row_count(*ops, 1, 1, 16, 16, BF16)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_cached_rows_of_prefill_and_decode_are_equal(ops, dtype):
    inputs, h0 = random_case(4, dtype, hk=1)
    check_cached_rows(ops[1], inputs, h0[:1], 7)


def test_one_row_tile_a_chunk(ops, modules, monkeypatch):
    """ROWS = CHUNK: the chunk kernels' products are one dot a chunk, the step pads its row into it."""
    monkeypatch.setattr(modules[1], "ROWS", 8)
    inputs, h0 = random_case(2, F32)
    check_schedules(*ops, inputs, h0, seeds=(1,))


def test_decode_only_step(ops):
    """decode_only (one launch, no host read): the decode rows after prefills, at held rows 4, 0 and 2."""
    from gated_delta_reference import first_difference
    from incremental_checks import fresh_cache, run_steps

    forward, cached = ops
    inputs = gdn_inputs([5, 9, 3], 1, 2, 16, 16, seed=6)
    with torch.no_grad():
        o, states = forward(**inputs)
        cache, started = fresh_cache(inputs, [2, 0, 1], None, 1)

        def step(**kw):
            return cached(**kw, decode_only=bool(kw["q"].shape[0] == kw["cu_seqlens"].shape[0] - 1))

        got = run_steps(step, inputs, [[(0, 4), (1, 8), (2, 2)], [(0, 1), (1, 1), (2, 1)]], [2, 0, 1], cache, started)
    assert torch.equal(got, o), first_difference(got, o)
    with pytest.raises(ValueError, match="decode_only"):
        cached(**{n: inputs[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "cu_seqlens")}, cache=cache,
               slots=torch.tensor([0, 1, 2]), has_state=torch.tensor([True] * 3), context_lens=torch.tensor([5, 9, 3]),
               decode_only=True)  # fmt: skip


def test_padded_requests_touch_nothing(ops):
    from incremental_checks import check_padded_requests

    check_padded_requests(ops[1])


def test_gradients_match_float64_autograd(ops):
    inputs, h0 = random_case(3, F32)
    check_gradients(ops[0], inputs, h0, rtol=2e-5)


def test_torch_path_agrees_to_rounding(ops):
    from vexact_vllm.kernels.gated_delta.incremental import incremental_gated_delta_rule

    inputs = gdn_inputs([11, 4], 2, 4, 16, 32, seed=4)
    with torch.no_grad():
        o, states = ops[0](**inputs)
        o_torch, states_torch = incremental_gated_delta_rule(**inputs)
    torch.testing.assert_close(o, o_torch, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(states, states_torch, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels): chunks of 64, d_k = d_v = 128
# ---------------------------------------------------------------------------------------------


def _cuda_ops():
    from vexact_vllm.kernels.gated_delta.incremental_triton import (
        incremental_gated_delta_rule_cached_triton,
        incremental_gated_delta_rule_triton,
    )

    return incremental_gated_delta_rule_triton, incremental_gated_delta_rule_cached_triton


@pytest.mark.cuda
@requires_cuda
def test_cuda_padded_requests_and_padding_rows():
    """As a replayed decode graph runs the step: padded requests and padding rows past the last sequence."""
    from incremental_checks import check_padded_requests

    check_padded_requests(_cuda_ops()[1], device="cuda")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hk,hv,dtype", [(16, 32, BF16), (16, 48, BF16), (16, 32, F32), (16, 48, F32)], ids=str)
def test_cuda_schedules_at_qwen_shapes(hk, hv, dtype):
    """Qwen3-Next (16 k heads, 32 v heads) and Qwen3.5 (16, 48), d = 128: random schedules (one decode
    only) from random boundary states against the training forward, bit for bit."""
    lengths = [200, 1, 64, 65, 127, 130, 9]
    inputs = gdn_inputs(lengths, hk, hv, 128, 128, dtype=dtype, seed=7, device="cuda")
    h0 = torch.randn(len(lengths), hv, 128, 128, generator=torch.Generator().manual_seed(7)) * 0.1
    h0[1::2] = 0.0
    o, states = check_schedules(*_cuda_ops(), inputs, h0.cuda(), seeds=(0, 1), max_chunk=150)
    _assert_accurate(o, states, inputs, h0, dtype, interpreted=False)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hv,dtype", [(32, BF16), (48, BF16), (48, F32)], ids=str)
def test_cuda_every_row_count(hv, dtype):
    """Each of the 64 row counts of a chunk: a prefill of p rows, the decode of row p, the rest."""
    check_every_row_count(*_cuda_ops(), 16, hv, 128, 128, dtype, device="cuda")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hv,dtype", [(32, BF16), (48, BF16), (48, F32)], ids=str)
@pytest.mark.parametrize("p", [6, 37, 63])
def test_cuda_cached_rows_of_prefill_and_decode_are_equal(hv, dtype, p):
    """The cache slot's per-row tensors (T included, which reaches o only rounded) after a prefill of p
    rows and after p decode steps, at Qwen3.5 / Qwen3-Next heads."""
    inputs = gdn_inputs([p], 16, hv, 128, 128, dtype=dtype, seed=7, device="cuda")
    h0 = (torch.randn(1, hv, 128, 128, generator=torch.Generator().manual_seed(7)) * 0.1).cuda()
    check_cached_rows(_cuda_ops()[1], inputs, h0, p)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hk,hv", [(2, 4), (16, 48)], ids=str)
def test_cuda_gradients_match_float64_autograd(hk, hv):
    """d = 128 (several chunks, a full one, a single row); the float64 reference runs on the CPU."""
    inputs = gdn_inputs([70, 1, 64], hk, hv, 128, 128, seed=8, device="cuda")
    h0 = (torch.randn(3, hv, 128, 128, generator=torch.Generator().manual_seed(8)) * 0.1).cuda()
    check_gradients(_cuda_ops()[0], inputs, h0, rtol=1e-4)
