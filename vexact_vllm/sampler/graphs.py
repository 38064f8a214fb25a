"""CUDA graphs of the decode step's lm_head and sampler (vLLM's model runner v2), per padded row count.

Why: vLLM replays the model's forward as one CUDA graph but runs `compute_logits` and the sampler
eagerly every step. Ours are Triton launches of 25-30 us of host time each (stock's are ATen calls
of ~5 us), and at small batches the decode step is host-bound: the GPU waits for them
(docs/results.md#sampler-graphs-host). Here both are captured once per bucket of rows and replayed.

What is captured, for each bucket b of BUCKETS up to the engine's max_num_reqs:
    lm_head:  hidden[:b] -> logits[:b]                                      one graph
    sampler:  logits[:b], tau[:b], seeds[:b], positions[:b] -> `kernels.sample_tokens`' outputs
              one graph per (draw, output) variant: draw "greedy", "sampled" or "mixed" (greedy
              where tau is 0); output "tokens", "token_log_probs" (tokens, their log-probs and
              ranks) or "log_probs" (tokens and the log-probs, written over the logits in place:
              the runner is done with them once it samples)
Every buffer is static (allocated once, outside the graphs); a step copies its inputs in (the hidden
rows; each row's temperature, seed and position gathered in one launch, kernels/sampling/gather_triton.py),
replays, and reads the outputs: the sampler returns clones of the tokens, their log-probs and ranks
(vLLM copies them to the host on another stream, which may still run when the next step replays)
and the log-probs as a view (read on this stream, by `compute_topk_scores`, before the next replay can write them).

Bits: a replay runs the eager path's kernels on the eager path's inputs (the same `linear` and
`sample_tokens`, writing through `out=`), so it gives the eager path's logits, tokens and
log-probs. Rows past the batch are padding: they hold stale rows of earlier steps, and every kernel
here is row-wise (a row's result depends on its own inputs only), so they change no real row and
their results are never read.

Eager instead (the same functions, so the same bits): batches above the largest bucket, truncated
sampling (top-k / top-p / min-p, whose threshold's work depends on the batch's options), tensor
parallelism (the lm_head's all-gather), `--enforce-eager` / cudagraph_mode NONE, and off CUDA.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from vexact_vllm.kernels import Sampled, linear, sample_tokens
from vexact_vllm.kernels.capture import gc_paused
from vexact_vllm.kernels.sampling.gather_triton import gather_rows
from vexact_vllm.kernels.sampling.sample import DRAWS, OUTPUTS

from .rules import GREEDY_EPS

# Padded row counts (one set of graphs each): fine-grained, since the sampler's kernels scale with
# rows; up to 256 (vLLM's default max_num_seqs), the static logits then costing 256 x V x 4 bytes
# (156 MB at V = 151,936; the log-probs are written over them). Past it a step's GPU time dwarfs
# the ~300 us of host time the eager path costs.
logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, so its handler prints it
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
VARIANTS = tuple((draw, output) for draw in DRAWS for output in OUTPUTS)


class Rerun:
    """The stand-in for a CUDA graph off CUDA (CPU tests of the buffer logic): a replay calls the
    captured function again, on the same static buffers."""

    def __init__(self, fn, pool=None):
        fn()
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class CudaGraph:
    """`fn`'s launches captured in a CUDA graph (after one eager run on a side stream: Triton compiles
    and autotunes nothing during a capture), in the shared memory pool `pool`."""

    def __init__(self, fn, pool):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """The buckets an engine of `max_rows` sampled rows a step uses (the last one covers max_rows up
    to BUCKETS' largest)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    top = min(max_rows, BUCKETS[-1])
    return tuple(b for b in BUCKETS if b < top) + (top,)


def _gather_into(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """out[i] = src[index[i]] with one launch (index_select needs out's dtype to be src's)."""
    if src.dtype == out.dtype:
        torch.index_select(src, 0, index, out=out)
    else:
        out.copy_(src[index])


class SamplerGraphs:
    """The static buffers and graphs of one engine's lm_head (`weight` [V, H]) and sampler."""

    def __init__(self, weight: torch.Tensor, max_rows: int, config_n: int | None = None, graph_cls=None):
        self.weight, self.config_n = weight, config_n
        self.buckets = buckets_for(max_rows)
        self.graph_cls = graph_cls or (CudaGraph if weight.is_cuda else Rerun)
        rows, (vocab, hidden) = self.buckets[-1], weight.shape
        dev = weight.device
        self.hidden = torch.zeros(rows, hidden, dtype=weight.dtype, device=dev)
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=dev)
        self.tau = torch.ones(rows, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)  # of the last input token
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.token_log_probs = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.ranks = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple, object] = {}

    def capture(self) -> None:
        """Every bucket's graphs, the largest first (one memory pool: later captures reuse its blocks)."""
        pool = torch.cuda.graph_pool_handle() if self.graph_cls is CudaGraph else None
        with gc_paused():
            for b in reversed(self.buckets):
                self.graphs[b, "lm_head"] = self.graph_cls(lambda b=b: self._lm_head(b), pool)
                for draw, output in VARIANTS:
                    self.graphs[b, draw, output] = self.graph_cls(lambda b=b, d=draw, o=output: self._sample(b, d, o), pool)
        static = sum(t.numel() * t.element_size() for t in (self.hidden, self.logits)) / 2**20
        logger.info(
            "vexact: lm_head and sampler captured in %d graphs for batches of 1-%d rows (%.0f MiB of static "
            "buffers)", len(self.graphs), self.buckets[-1], static,
        )  # fmt: skip

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`, or None (eager) past the largest or for 0 rows."""
        return next((b for b in self.buckets if b >= rows), None) if rows > 0 else None

    # --- what the graphs run ------------------------------------------------------------------

    def _lm_head(self, b: int) -> None:
        linear(self.hidden[:b], self.weight, out_dtype=torch.float32, config_n=self.config_n, out=self.logits[:b])

    def _sample(self, b: int, draw: str, output: str) -> None:
        out = Sampled(
            self.tokens[:b],
            self.token_log_probs[:b] if output == "token_log_probs" else None,
            self.ranks[:b] if output == "token_log_probs" else None,
            self.logits[:b] if output == "log_probs" else None,  # in place: each element read, then written
        )
        positions = self.positions[:b] + 1  # the sampled token's position: its noise key
        sample_tokens(self.logits[:b], self.tau[:b], self.seeds[:b], positions, draw=draw, output=output, out=out)

    # --- a step -------------------------------------------------------------------------------

    def owns(self, logits: torch.Tensor) -> bool:
        """Whether `logits` are rows of the static logits this object's lm_head graph wrote."""
        return logits.data_ptr() == self.logits.data_ptr() and self.bucket(logits.shape[0]) is not None

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 [N, V] logits of `hidden` [N, H] by a replay (a view of the static logits, valid until
        the next call), or None when N has no bucket (the caller runs `linear` eagerly)."""
        b = self.bucket(hidden.shape[0])
        if b is None or (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        n = hidden.shape[0]
        self.hidden[:n].copy_(hidden)
        self.graphs[b, "lm_head"].replay()
        return self.logits[:n]

    def sample(
        self,
        n: int,
        draw: str,
        output: str,
        *,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        req_index: torch.Tensor,
        positions: torch.Tensor,
        logits_index: torch.Tensor,
        zero_tiny_temperatures: bool = False,
    ) -> Sampled:
        """`kernels.sample_tokens(..., draw=, output=)` of the static logits' first n rows (`owns`) by
        a replay: clones of the tokens, token log-probs and ranks; the log-probs as a view (they
        replace those logits). Row i's temperature and seed are temperature[req_index[i]] and
        seeds[req_index[i]] (vLLM's per-request states), its last input token's position
        positions[logits_index[i]]. `zero_tiny_temperatures`: temperatures in (0, GREEDY_EPS),
        greedy for vLLM, count as 0 (the eager sampler's `rows`)."""
        b = self.bucket(n)
        if b is None or (draw, output) not in VARIANTS:
            raise ValueError(f"no sampler graph for {n} rows, {draw!r}, {output!r} (buckets {self.buckets})")
        tau = self.tau[:n]
        triples = [(tau, temperature, req_index)]
        if draw != "greedy":
            triples += [(self.seeds[:n], seeds, req_index), (self.positions[:n], positions, logits_index)]
        if tau.is_cuda:  # one launch (index_select's small-index kernel is serial: gather_triton.py)
            gather_rows(triples, zero_below=GREEDY_EPS if zero_tiny_temperatures else None)
        else:
            for out, src, index in triples:
                _gather_into(out, src, index)
            if zero_tiny_temperatures:
                tau.masked_fill_(tau < GREEDY_EPS, 0.0)
        self.graphs[b, draw, output].replay()
        with_lp = output == "token_log_probs"
        return Sampled(
            self.tokens[:n].clone(),
            self.token_log_probs[:n].clone() if with_lp else None,
            self.ranks[:n].clone() if with_lp else None,
            self.logits[:n] if output == "log_probs" else None,
        )
