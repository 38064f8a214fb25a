"""The fused sampling step (kernels/sampling/sample.py, sample_triton.py) against its definition, the
composition log_softmax -> argmax / gumbel_argmax -> gather -> rank, bit for bit: the torch path on
CPU, the Triton kernels under the interpreter (CPU tensors, small vocabularies) and compiled on CUDA
(the Qwen3 vocabulary)."""

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import

from vexact_vllm.kernels import sample_tokens  # noqa: E402
from vexact_vllm.kernels.sampling.sample import DRAWS, OUTPUTS, Sampled  # noqa: E402

MODULES = (
    "vexact_vllm.kernels.sampling.sample_triton",
    "vexact_vllm.kernels.sampling.logprob_triton",
    "vexact_vllm.kernels.sampling.gumbel_triton",
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def interpreted(interpreted_modules):
    return interpreted_modules(MODULES)


def _inputs(rows, vocab, device="cpu", scale=3.0):
    logits = torch.randn(rows, vocab, device=device) * scale
    temps = torch.rand(rows, device=device) + 0.3
    temps[torch.rand(rows, device=device) < 0.3] = 0.0  # greedy rows among sampled ones
    temps[0] = 0.0
    if rows > 1:
        temps[1] = 0.005  # below vLLM's 0.01 floor: scored (and sampled) at 0.01
    seeds = torch.randint(-(2**62), 2**62, (rows,), device=device)
    positions = torch.randint(0, 40000, (rows,), device=device)
    return logits, temps, seeds, positions


def _composition(log_softmax, gumbel_argmax, logits, temps, seeds, positions, draw):
    """The definition (sample.py's docstring), from the given log_softmax / gumbel_argmax."""
    log_probs = log_softmax(logits, temps)
    greedy = log_probs.argmax(-1)
    drawn = gumbel_argmax(log_probs, seeds, positions)
    tokens = {"greedy": greedy, "sampled": drawn, "mixed": torch.where(temps == 0, greedy, drawn)}[draw]
    token_lp = log_probs.gather(1, tokens[:, None])[:, 0]
    ranks = (log_probs >= token_lp[:, None]).sum(-1)
    return Sampled(tokens, token_lp, ranks, log_probs)


def _check(got: Sampled, want: Sampled, output: str) -> None:
    assert torch.equal(got.tokens, want.tokens)
    if output == "token_log_probs":
        assert torch.equal(got.token_log_probs, want.token_log_probs)
        assert torch.equal(got.ranks, want.ranks)
        assert got.log_probs is None
    elif output == "log_probs":
        assert torch.equal(got.log_probs, want.log_probs)
        assert got.token_log_probs is None and got.ranks is None
    else:
        assert got.token_log_probs is None and got.ranks is None and got.log_probs is None


def _interpreted_sample(st, logits, temps, seeds, positions, draw, output):
    """sample_triton (interpreted) through the public function's checks and buffers."""
    from vexact_vllm.kernels.sampling import sample as sample_mod

    impls = dict(sample_mod._IMPLS)
    sample_mod._IMPLS["torch"] = lambda *args: st.sample_triton(*args[:6], *args[6])
    try:
        return sample_tokens(logits, temps, seeds, positions, draw=draw, output=output)
    finally:
        sample_mod._IMPLS.update(impls)


# ---------------------------------------------------------------------------------------------
# torch path (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("output", OUTPUTS)
def test_torch_path_is_the_composition(draw, output):
    from vexact_vllm.kernels import gumbel_argmax, log_softmax

    logits, temps, seeds, positions = _inputs(9, 1000)
    got = sample_tokens(logits, temps, seeds, positions, draw=draw, output=output)
    _check(got, _composition(log_softmax, gumbel_argmax, logits, temps, seeds, positions, draw), output)
    for i in (0, 4, 8):  # a row alone = the row in the batch
        rows = slice(i, i + 1)
        alone = sample_tokens(logits[rows], temps[rows], seeds[rows], positions[rows], draw=draw, output=output)
        assert torch.equal(alone.tokens, got.tokens[rows])
        if output == "token_log_probs":
            assert torch.equal(alone.token_log_probs, got.token_log_probs[rows])


def test_writes_into_out_and_log_probs_in_place():
    logits, temps, seeds, positions = _inputs(6, 500)
    want = sample_tokens(logits, temps, seeds, positions, draw="mixed", output="log_probs")
    buf = logits.clone()
    out = Sampled(torch.full((6,), -1, dtype=torch.int64), log_probs=buf)
    assert sample_tokens(buf, temps, seeds, positions, draw="mixed", output="log_probs", out=out) is out
    assert torch.equal(out.tokens, want.tokens) and torch.equal(buf, want.log_probs)  # over the logits


def test_refuses_bad_arguments():
    logits, temps, seeds, positions = _inputs(3, 50)
    with pytest.raises(ValueError, match="draw must be one of"):
        sample_tokens(logits, temps, seeds, positions, draw="top_k")
    with pytest.raises(ValueError, match="output must be one of"):
        sample_tokens(logits, temps, seeds, positions, draw="sampled", output="probs")
    with pytest.raises(ValueError, match="seeds must be a torch.Tensor"):
        sample_tokens(logits, temps, None, positions, draw="sampled")
    with pytest.raises(ValueError, match="positions must have shape"):
        sample_tokens(logits, temps, seeds, positions[:2], draw="mixed")
    with pytest.raises(ValueError, match="out.ranks must be a buffer"):
        sample_tokens(logits, temps, seeds, positions, draw="greedy", output="token_log_probs",
                      out=Sampled(torch.empty(3, dtype=torch.int64), torch.empty(3)))  # fmt: skip
    with pytest.raises(ValueError, match="out must be a contiguous"):
        sample_tokens(logits, temps, None, None, draw="greedy", out=Sampled(torch.empty(3, dtype=torch.int32)))
    assert sample_tokens(logits, temps, None, None, draw="greedy").tokens.shape == (3,)  # greedy needs no key


# ---------------------------------------------------------------------------------------------
# Triton, interpreted (CPU tensors)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [7, 4096 + 5, 2 * 8192 + 37])
def test_interpreted_equals_the_composition(interpreted, vocab):
    """Every draw and output, one to three chunks, the last one short: the same bits as the Triton
    log_softmax, gumbel_argmax, argmax, gather and rank one after another; a row alone = in a batch."""
    st, lt, gt = interpreted
    logits, temps, seeds, positions = _inputs(5, vocab)
    logits[3, : vocab // 2] = float("-inf")  # a blocked vocabulary range (a whole chunk at 3 chunks)
    tau_of = lambda t: t.reshape(-1, 1)  # the Triton log-softmax takes requested temperatures [M, 1]
    want = {
        draw: _composition(lambda z, t: lt.log_softmax_triton(z, tau_of(t)), gt.gumbel_argmax_triton, logits,
                           temps, seeds, positions, draw)
        for draw in DRAWS
    }  # fmt: skip
    for draw in DRAWS:
        for output in OUTPUTS:
            got = _interpreted_sample(st, logits, temps, seeds, positions, draw, output)
            _check(got, want[draw], output)
        alone = _interpreted_sample(st, logits[4:], temps[4:], seeds[4:], positions[4:], draw, "token_log_probs")
        assert torch.equal(alone.tokens, want[draw].tokens[4:])
        assert torch.equal(alone.token_log_probs, want[draw].token_log_probs[4:])
        assert torch.equal(alone.ranks, want[draw].ranks[4:])


def test_interpreted_ties_take_the_first_id_and_count_in_the_rank(interpreted):
    """A greedy row whose maximum repeats in later blocks and chunks takes the first id, and its rank
    counts every tie (vLLM's `>=`)."""
    st = interpreted[0]
    vocab = 2 * 8192 + 100
    logits = torch.randn(2, vocab)
    ids = [4100, 8192 + 3, 8192 + 4500, 2 * 8192 + 7]  # second block, second chunk twice, third chunk
    logits[0, ids] = 50.0
    logits[1, ids[1:]] = 50.0
    temps = torch.zeros(2)
    got = _interpreted_sample(st, logits, temps, None, None, "greedy", "token_log_probs")
    assert got.tokens.tolist() == [ids[0], ids[1]]
    assert got.ranks.tolist() == [4, 3]


def test_interpreted_writes_the_log_probs_in_place(interpreted):
    st, lt, _ = interpreted
    logits, temps, seeds, positions = _inputs(4, 9000)
    want = lt.log_softmax_triton(logits, temps.reshape(-1, 1))
    buf = logits.clone()
    tokens = torch.empty(4, dtype=torch.int64)
    st.sample_triton(buf, temps, seeds, positions, "sampled", "log_probs", tokens, None, None, buf)
    assert torch.equal(buf, want)
    assert torch.equal(tokens, interpreted[2].gumbel_argmax_triton(want, seeds, positions))


# ---------------------------------------------------------------------------------------------
# CUDA (the compiled kernels, the Qwen3 vocabulary)
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("draw", DRAWS)
def test_cuda_equals_the_composition_and_is_batch_invariant(draw):
    from vexact_vllm.kernels import gumbel_argmax, log_softmax

    logits, temps, seeds, positions = _inputs(300, 151936, "cuda", scale=4.0)
    want = _composition(log_softmax, gumbel_argmax, logits, temps, seeds, positions, draw)
    for output in OUTPUTS:
        _check(sample_tokens(logits, temps, seeds, positions, draw=draw, output=output), want, output)
    got = sample_tokens(logits, temps, seeds, positions, draw=draw, output="token_log_probs")
    for rows in (slice(0, 1), slice(17, 18), slice(5, 70), slice(299, 300)):
        part = sample_tokens(logits[rows], temps[rows], seeds[rows], positions[rows], draw=draw,
                             output="token_log_probs")  # fmt: skip
        assert torch.equal(part.tokens, got.tokens[rows])
        assert torch.equal(part.token_log_probs, got.token_log_probs[rows])
        assert torch.equal(part.ranks, got.ranks[rows])
    perm = torch.randperm(300, device="cuda")
    shuffled = sample_tokens(logits[perm], temps[perm], seeds[perm], positions[perm], draw=draw,
                             output="token_log_probs")  # fmt: skip
    assert torch.equal(shuffled.tokens, got.tokens[perm])
    assert torch.equal(shuffled.token_log_probs, got.token_log_probs[perm])


@pytest.mark.cuda
@requires_cuda
def test_cuda_in_place_log_probs_and_graph_replay():
    """Written over the logits (the sampler graph's static buffer), captured and replayed: the eager bits."""
    from vexact_vllm.kernels.capture import gc_paused

    logits, temps, seeds, positions = _inputs(64, 151936, "cuda", scale=4.0)
    want = sample_tokens(logits, temps, seeds, positions, draw="mixed", output="log_probs")
    static = logits.clone()
    out = Sampled(torch.empty(64, dtype=torch.int64, device="cuda"), log_probs=static)
    sample_tokens(static, temps, seeds, positions, draw="mixed", output="log_probs", out=out)  # compile
    tok_out = Sampled(*(torch.empty(64, dtype=d, device="cuda") for d in (torch.int64, torch.float32, torch.int64)))
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        sample_tokens(static, temps, seeds, positions, draw="mixed", output="log_probs", out=out)
    with gc_paused():
        sample_tokens(logits, temps, seeds, positions, draw="mixed", output="token_log_probs", out=tok_out)
        token_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(token_graph):
            sample_tokens(logits, temps, seeds, positions, draw="mixed", output="token_log_probs", out=tok_out)
    static.copy_(logits)
    out.tokens.fill_(-1)
    graph.replay()
    tok_out.ranks.fill_(-5)  # the replay zeroes the ranks before counting
    token_graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, want.log_probs) and torch.equal(out.tokens, want.tokens)
    token_lp = want.log_probs.gather(1, want.tokens[:, None])[:, 0]
    assert torch.equal(tok_out.tokens, want.tokens) and torch.equal(tok_out.token_log_probs, token_lp)
    assert torch.equal(tok_out.ranks, (want.log_probs >= token_lp[:, None]).sum(-1))
