"""The decode step's lm_head and sampler graphs (sampler/graphs.py) against the eager path, bit for bit.

On CPU the graphs are `Rerun` stand-ins (a replay calls the captured function again on the static
buffers): that covers the buckets, the padding, the static buffers and the variants. On CUDA the
same tests run with real CUDA graphs at the Qwen3 vocabulary (`-m cuda`, on the GPU host)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _graphs(device, vocab, hidden, max_rows, dtype=torch.bfloat16):
    from vexact_vllm.sampler.graphs import SamplerGraphs

    weight = (torch.randn(vocab, hidden, device=device) * 0.5).to(dtype)
    graphs = SamplerGraphs(weight, max_rows)
    graphs.capture()
    return graphs


def _eager(graphs, hidden, temperature, seeds, positions, greedy_tiny=False):
    """The sampler's composition (v2.py's rows, log_softmax, draw_tokens, then the token's
    log-prob and vLLM's rank) on the same rows: (logits, Sampled with every field)."""
    from vexact_vllm.kernels import Sampled, linear, log_softmax
    from vexact_vllm.sampler.rules import GREEDY_EPS, draw_tokens

    logits = linear(hidden, graphs.weight, out_dtype=torch.float32)
    tau = temperature.clone()
    if greedy_tiny:
        tau = torch.where(tau < GREEDY_EPS, torch.zeros_like(tau), tau)
    log_probs = log_softmax(logits, tau)
    host_greedy = (tau < GREEDY_EPS).cpu().numpy()
    greedy = tau < GREEDY_EPS if host_greedy.any() and not host_greedy.all() else None
    tokens = draw_tokens(log_probs, greedy, host_greedy, seeds, positions + 1, None)
    token_lp = log_probs.gather(1, tokens[:, None])[:, 0]
    return logits, Sampled(tokens, token_lp, (log_probs >= token_lp[:, None]).sum(-1), log_probs)


def _step(graphs, n, draw, output, device, rng, tiny=False):
    """One random step through the graphs, checked against the composition (draws from torch's
    global generator, seeded by the test, and `rng`; messages name the step)."""
    case = f"n={n} draw={draw} output={output} device={device} tiny={tiny}"
    slots = 3 * graphs.buckets[-1]
    temperature = torch.rand(slots, device=device) + 0.3
    if draw == "greedy":
        temperature.zero_()
    elif draw == "mixed":
        temperature[torch.rand(slots, device=device) < 0.5] = 0.0
        temperature[0] = 0.0
        temperature[1] = 0.9
        if tiny:
            temperature[2] = 5e-6  # greedy for vLLM: the graph must zero it as the eager path does
    seeds = torch.randint(-(2**62), 2**62, (slots,), device=device)
    req_index = torch.tensor(rng.sample(range(slots), n), device=device, dtype=torch.int32)
    if draw == "mixed":
        req_index[: min(n, 3)] = torch.arange(min(n, 3), device=device, dtype=torch.int32)
    positions = torch.randint(0, 30000, (4 * n,), device=device)
    logits_index = torch.tensor(sorted(rng.sample(range(4 * n), n)), device=device)
    hidden = torch.randn(n, graphs.hidden.shape[1], device=device).to(graphs.hidden.dtype)
    # stale padding: whatever sits past row n must not reach a real row
    graphs.hidden[n:] = float("nan")
    graphs.tau[n:] = 1e-3
    logits = graphs.lm_head(hidden)
    assert graphs.owns(logits) and logits.shape == (n, graphs.weight.shape[0]), case
    logits = logits.clone()  # the "log_probs" output writes over the static logits
    got = graphs.sample(
        n, draw, output, temperature=temperature, seeds=seeds, req_index=req_index, positions=positions,
        logits_index=logits_index, zero_tiny_temperatures=tiny,
    )  # fmt: skip
    ref_logits, ref = _eager(
        graphs, hidden, temperature[req_index.long()], seeds[req_index.long()], positions[logits_index], tiny
    )
    assert torch.equal(logits, ref_logits), case
    assert torch.equal(got.tokens, ref.tokens), case
    with_lp = output == "token_log_probs"
    assert (got.token_log_probs is not None, got.ranks is not None) == (with_lp, with_lp), case
    if with_lp:
        assert torch.equal(got.token_log_probs, ref.token_log_probs) and torch.equal(got.ranks, ref.ranks), case
    assert (got.log_probs is not None) == (output == "log_probs"), case
    if output == "log_probs":
        assert torch.equal(got.log_probs, ref.log_probs), case
    for static in (graphs.tokens, graphs.token_log_probs, graphs.ranks):
        static.fill_(-7)  # the next replay writes here: the returned tokens, log-probs and ranks are clones
    assert torch.equal(got.tokens, ref.tokens), case
    if with_lp:
        assert torch.equal(got.token_log_probs, ref.token_log_probs) and torch.equal(got.ranks, ref.ranks), case
    return got.tokens


def test_buckets_cover_the_engine_rows():
    from vexact_vllm.sampler.graphs import BUCKETS, buckets_for

    assert buckets_for(1) == (1,)
    assert buckets_for(20) == (1, 2, 4, 8, 16, 20)
    assert buckets_for(16) == (1, 2, 4, 8, 16)
    assert buckets_for(1024) == BUCKETS
    assert buckets_for(200) == (*BUCKETS[: BUCKETS.index(192) + 1], 200)
    with pytest.raises(ValueError, match="max_rows"):
        buckets_for(0)


def test_bucket_and_ownership():
    graphs = _graphs("cpu", 50, 16, 20)
    assert [graphs.bucket(n) for n in (0, 1, 3, 16, 17, 20, 21)] == [None, 1, 4, 16, 20, 20, None]
    assert graphs.owns(graphs.logits[:5])
    assert not graphs.owns(torch.zeros(5, 50))
    assert graphs.lm_head(torch.zeros(21, 16, dtype=torch.bfloat16)) is None  # past the largest: eager
    with pytest.raises(ValueError, match="no sampler graph"):
        graphs.sample(21, "sampled", "tokens", temperature=graphs.tau, seeds=graphs.seeds,
                      req_index=graphs.seeds[:21], positions=graphs.positions, logits_index=graphs.seeds[:21])  # fmt: skip
    with pytest.raises(ValueError, match="no sampler graph"):
        graphs.sample(2, "sampled", "probs", temperature=graphs.tau, seeds=graphs.seeds,
                      req_index=graphs.seeds[:2], positions=graphs.positions, logits_index=graphs.seeds[:2])  # fmt: skip


@pytest.mark.parametrize("draw", ["greedy", "sampled", "mixed"])
def test_replays_equal_the_eager_path(draw):
    from vexact_vllm.kernels.sampling.sample import OUTPUTS

    torch.manual_seed(1)
    rng = random.Random(2)
    graphs = _graphs("cpu", 3000, 32, 24)
    for n in rng.sample(range(1, 25), 6):
        for output in OUTPUTS:
            _step(graphs, n, draw, output, "cpu", rng)


def test_tiny_temperatures_are_greedy_in_the_graph_too():
    torch.manual_seed(3)
    graphs = _graphs("cpu", 700, 16, 8)
    _step(graphs, 5, "mixed", "token_log_probs", "cpu", random.Random(4), tiny=True)


def test_a_row_samples_the_same_token_in_every_bucket():
    """Padding and bucket size never reach a row: one request alone (bucket 1) and among others."""
    torch.manual_seed(5)
    graphs = _graphs("cpu", 2000, 16, 32)
    hidden = torch.randn(32, 16).to(torch.bfloat16)
    seeds = torch.randint(0, 2**40, (32,))
    temperature = torch.full((32,), 0.8)
    positions = torch.arange(32) * 7
    out = {}
    for n in (1, 3, 9, 32):
        graphs.lm_head(hidden[:n])
        idx = torch.arange(n, dtype=torch.int32)
        got = graphs.sample(n, "sampled", "token_log_probs", temperature=temperature, seeds=seeds,
                            req_index=idx, positions=positions, logits_index=torch.arange(n))  # fmt: skip
        out[n] = torch.stack([got.tokens.double(), got.token_log_probs.double(), got.ranks.double()], 1)
    for n in (3, 9, 32):
        assert torch.equal(out[n][: min(n, 3)], out[32][: min(n, 3)])
    assert torch.equal(out[1], out[32][:1])


def _sampler_v2(graphs, temperature, seeds, top_p):
    from vexact_vllm.sampler.v2 import VexactSamplerV2

    def state(values, dtype):
        t = torch.tensor(values, dtype=dtype)
        return SimpleNamespace(gpu=t, np=t.numpy())

    slots = len(temperature)
    base = SimpleNamespace(
        sampling_states=SimpleNamespace(
            temperature=state(temperature, torch.float32),
            seeds=state(seeds, torch.int64),
            top_k=state([0] * slots, torch.int32),
            top_p=state(top_p, torch.float32),
            min_p=state([0.0] * slots, torch.float32),
        )
    )
    sampler = VexactSamplerV2.from_base(base)
    sampler.graphs = graphs
    return sampler


def test_sampler_v2_takes_the_graph_only_where_it_may():
    """The runner-v2 sampler's graph step equals its eager rows + draw; truncation stays eager."""
    from vexact_vllm.kernels import log_softmax
    from vexact_vllm.sampler.rules import draw_tokens, truncates

    torch.manual_seed(6)
    graphs = _graphs("cpu", 900, 16, 8)
    temperature, seeds = [0.7, 0.0, 1.2, 0.9], [5, 6, 7, 8]
    sampler = _sampler_v2(graphs, temperature, seeds, [1.0, 1.0, 1.0, 0.9])
    batch = SimpleNamespace(
        expanded_idx_mapping=torch.tensor([2, 0, 1], dtype=torch.int32),
        idx_mapping_np=np.array([2, 0, 1]),
        positions=torch.tensor([4, 9, 13, 2, 30]),
        logits_indices=torch.tensor([1, 2, 4]),
    )
    logits = graphs.lm_head(torch.randn(3, 16).to(torch.bfloat16))
    logits_before = logits.clone()
    host_t = np.array(temperature, np.float32)[batch.idx_mapping_np]
    host_greedy = host_t < 1e-5
    got = sampler._sample_graphed(logits, batch, host_t, "mixed", "log_probs")
    tau, s, pos = sampler.rows(batch, host_t)
    ref_lp = log_softmax(logits_before, tau)
    ref = draw_tokens(ref_lp, tau < 1e-5, host_greedy, s, pos, None)
    assert torch.equal(got.log_probs, ref_lp) and torch.equal(got.tokens, ref)
    # a batch with a top-p row truncates: the sampler must not take the graph for it
    top_p = sampler.sampling_states.top_p.np[np.array([3, 0])]
    assert truncates(900, np.zeros(2, np.int32), top_p, np.zeros(2, np.float32))
    assert not truncates(900, np.array([0, 900]), np.ones(2, np.float32), np.zeros(2, np.float32))


def test_kernels_write_through_out():
    """`out=` of linear, log_softmax and gumbel_argmax: the same bits, and clear errors."""
    from vexact_vllm.kernels import gumbel_argmax, linear, log_softmax

    torch.manual_seed(9)
    x, w = torch.randn(5, 32).to(torch.bfloat16), torch.randn(70, 32).to(torch.bfloat16)
    out = torch.empty(5, 70)
    assert linear(x, w, out_dtype=torch.float32, out=out) is out
    assert torch.equal(out, linear(x, w, out_dtype=torch.float32))
    lp = torch.empty(5, 70)
    tau = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.005])
    assert torch.equal(log_softmax(out, tau, out=lp), log_softmax(out, tau))
    in_place = out.clone()
    assert torch.equal(log_softmax(in_place, tau, out=in_place), lp)
    tok = torch.empty(5, dtype=torch.int64)
    seeds, pos = torch.arange(5), torch.arange(5) + 100
    assert torch.equal(gumbel_argmax(lp, seeds, pos, out=tok), gumbel_argmax(lp, seeds, pos))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        linear(x, w, out_dtype=torch.float32, out=torch.empty(5, 70, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        log_softmax(out, tau, out=torch.empty(70, 5).t())
    with pytest.raises(ValueError, match="out must be a contiguous"):
        gumbel_argmax(lp, seeds, pos, out=torch.empty(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="inference"):
        linear(x, w.float().requires_grad_().to(torch.bfloat16), out_dtype=torch.float32, out=out)
    with pytest.raises(ValueError, match="inference"):
        log_softmax(out.clone().requires_grad_(), tau, out=lp)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("draw", ["greedy", "sampled", "mixed"])
def test_cuda_graph_replays_equal_the_eager_path(draw):
    """Real CUDA graphs at the Qwen3 vocabulary and hidden size: every bucket's replay of every
    output gives the eager kernels' logits, tokens, log-probs and ranks, with NaN padding in the
    static buffers."""
    from vexact_vllm.kernels.sampling.sample import OUTPUTS

    torch.manual_seed(7)
    rng = random.Random(8)
    graphs = _graphs("cuda", 151936, 2048, 256)
    for n in [1, 2, 16, 17, 128, 256] + rng.sample(range(3, 256), 5):
        for output in OUTPUTS:
            _step(graphs, n, draw, output, "cuda", rng, tiny=draw == "mixed" and n > 3)


def test_no_graphs_where_the_engine_runs_eagerly_or_sharded():
    """`--enforce-eager` (cudagraph_mode NONE), tensor parallelism and CPU keep the eager sampler."""
    from vexact_vllm.sampler.v2 import VexactSamplerV2

    base = SimpleNamespace(sampling_states=SimpleNamespace(max_num_reqs=8))
    model = SimpleNamespace(tp=None, sampler_graphs=None)
    cuda = torch.device("cuda")
    for sampler, device in (
        (VexactSamplerV2.from_base(base, model, use_graphs=False), cuda),  # enforce-eager
        (VexactSamplerV2.from_base(base, SimpleNamespace(tp=object(), sampler_graphs=None), True), cuda),
        (VexactSamplerV2.from_base(base, model, use_graphs=True), torch.device("cpu")),
        (VexactSamplerV2.from_base(base, None, use_graphs=True), cuda),
    ):
        sampler._capture_graphs(device)  # returns before touching the device
        assert sampler.graphs is None and model.sampler_graphs is None


def test_compute_logits_replays_where_a_bucket_fits():
    from vexact_vllm.kernels import linear
    from vexact_vllm.vllm_wrapper import VllmVexactForCausalLM

    torch.manual_seed(10)
    graphs = _graphs("cpu", 90, 16, 4)
    model = SimpleNamespace(sampler_graphs=graphs, lm_head_weight=graphs.weight, lm_head_config_n=None, tp=None)
    for rows, graphed in ((3, True), (4, True), (5, False)):
        hidden = torch.randn(rows, 16).to(torch.bfloat16)
        logits = VllmVexactForCausalLM.compute_logits(model, hidden)
        assert graphs.owns(logits) == graphed
        assert torch.equal(logits, linear(hidden, graphs.weight, out_dtype=torch.float32))
