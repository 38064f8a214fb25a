"""kernels/sampling/gather_triton.py (the sampler's one-launch input gather): the interpreter on CPU tensors, the
compiled kernel on CUDA; every value equals index_select's (then masked_fill's), bit for bit."""

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import


@pytest.fixture(scope="module")
def interpreted(import_interpreted):
    """gather_triton compiled for the interpreter (CPU tensors)."""
    return import_interpreted("vexact_vllm.kernels.sampling.gather_triton")


def _case(gen, n, device, index_dtype):
    """vLLM-like per-request states (more requests than rows, some temperatures tiny) and indices,
    one of them strided, as `SamplerGraphs.sample` passes them."""
    states = int(torch.randint(n, 3 * n + 2, (), generator=gen))
    temperature = torch.rand(states, generator=gen) * 2
    temperature[torch.rand(states, generator=gen) < 0.3] = 1e-7  # tiny: greedy for vLLM
    temperature[0] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (states,), generator=gen)
    positions = torch.randint(0, 40_000, (2 * states,), generator=gen)[::2]  # strided source
    req_index = torch.randint(0, states, (n,), generator=gen).to(index_dtype)
    logits_index = torch.randint(0, states, (n,), generator=gen).to(index_dtype)
    move = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return move(temperature, seeds, positions, req_index, logits_index)


def _check(gather_rows, device, seed):
    gen = torch.Generator().manual_seed(seed)
    for n in (1, 5, 16, 17, int(torch.randint(18, 300, (), generator=gen))):
        for index_dtype in (torch.int32, torch.int64):
            temperature, seeds, positions, req_index, logits_index = _case(gen, n, device, index_dtype)
            tau = torch.full((n,), float("nan"), device=device)
            out_seeds = torch.zeros(n, dtype=torch.int64, device=device)
            out_pos = torch.zeros(n, dtype=torch.int64, device=device)
            for zero in (None, 1e-5):
                gather_rows([(tau, temperature, req_index), (out_seeds, seeds, req_index),
                             (out_pos, positions, logits_index)], zero_below=zero)  # fmt: skip
                want = torch.index_select(temperature, 0, req_index)
                if zero is not None:
                    want = want.masked_fill(want < zero, 0.0)
                assert torch.equal(tau, want)
                assert torch.equal(out_seeds, torch.index_select(seeds, 0, req_index))
                assert torch.equal(out_pos, torch.index_select(positions, 0, logits_index))
            one = torch.zeros(n, device=device)  # one triple only: the others' slots untouched
            out_seeds.zero_()
            gather_rows([(one, temperature, req_index)])
            assert torch.equal(one, torch.index_select(temperature, 0, req_index))
            assert not out_seeds.any()


def test_interpreted_gathers_equal_index_select(interpreted):
    _check(interpreted.gather_rows, "cpu", seed=int(torch.randint(0, 2**31, ())))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_cuda_gathers_equal_index_select():
    from vexact_vllm.kernels.sampling.gather_triton import gather_rows

    _check(gather_rows, "cuda", seed=1)


def test_bad_input_says_what_is_wrong(interpreted):
    x = torch.zeros(4)
    i = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="one to three"):
        interpreted.gather_rows([])
    with pytest.raises(ValueError, match="one length"):
        interpreted.gather_rows([(x, x, i[:3])])
    with pytest.raises(ValueError, match="int32 or int64"):
        interpreted.gather_rows([(x, x, i.float())])
    with pytest.raises(ValueError, match="contiguous out"):
        interpreted.gather_rows([(torch.zeros(8)[::2], x, i)])
