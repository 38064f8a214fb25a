"""The log-probs both runners return beside a token, from the vexact log-probs, in vLLM's
`LogprobsTensors`: the token's log-prob and rank and the row's top-k (`kernels.score_tokens`: exact
ties to the lower token id, vLLM's rank = the count of log-probs >= the token's, every value gathered
from the one log-prob function's output, no arithmetic). Sampled and prompt tokens, on both runners,
go through these functions:

- `gather_logprobs`: the V1 runner's `Sampler.gather_logprobs`, which `VexactSampler` (v1.py) is:
  vLLM's V1 runner calls it for the sampled tokens and, per prefill chunk, for the prompt tokens, on
  `VexactSampler.compute_logprobs`' log-probs (temperature 1);
- `topk_scores`: runner v2's sampled tokens (v2.py), `logprob_token_ids` included;
- runner v2's prompt tokens: prompt_logprobs.py, `score_tokens` per chunk of prompt rows.
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import LogprobsTensors

from vexact_vllm.kernels import score_tokens, token_ranks, top_k_ids


def gather_logprobs(log_probs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """vLLM V1's `Sampler.gather_logprobs` over fp32 log-probs [N, V]: ids [N, 1 + k] (int32: the
    token, then the top-k), their log-probs, the tokens' ranks. `num_logprobs` -1: the whole vocabulary."""
    k = log_probs.shape[1] if num_logprobs == -1 else num_logprobs
    scores = score_tokens(log_probs, token_ids, k)
    return LogprobsTensors(scores.ids.to(torch.int32), scores.log_probs, scores.ranks)


def topk_scores(
    log_probs: torch.Tensor,
    num_logprobs: int,
    sampled: torch.Tensor,
    cu_num_logits: list[int] | None = None,
    custom_ids: torch.Tensor | None = None,
    custom_counts: torch.Tensor | None = None,
) -> LogprobsTensors:
    """Runner v2's `compute_topk_scores` in logits mode, over fp32 log-probs [B, V]: column 0 the
    sampled token, then per row either its own `logprob_token_ids` (`custom_ids` [B, W], the first
    `custom_counts[b]` of row b; W = the batch's largest count) or, for a row without them, the top
    `num_logprobs` ids; ids [B, 1 + max(k, W)] with 0 and log-prob -inf in the columns a row leaves
    empty (as vLLM), and the sampled tokens' ranks."""
    if custom_ids is None:
        scores = score_tokens(log_probs, sampled, num_logprobs)
        return LogprobsTensors(scores.ids, scores.log_probs, scores.ranks, cu_num_logits)
    n_rows, k, width = log_probs.shape[0], num_logprobs, custom_ids.shape[1]
    cols = max(k, width)
    col = torch.arange(cols, device=log_probs.device)  # [C]
    top = torch.nn.functional.pad(top_k_ids(log_probs, k), (0, cols - k))  # [B, C]
    custom = torch.nn.functional.pad(custom_ids.long(), (0, cols - width))  # [B, C]
    counts = custom_counts.long()[:, None]  # [B, 1]
    has_custom = counts > 0
    valid = torch.where(has_custom, col < counts, col < k)  # [B, C]
    rest = torch.where(has_custom, custom, top).masked_fill(~valid, 0)
    ids = torch.cat((sampled.long()[:, None], rest), dim=1)  # [B, 1 + C]
    valid = torch.cat((torch.ones(n_rows, 1, dtype=torch.bool, device=valid.device), valid), dim=1)
    values = log_probs.gather(1, ids).masked_fill(~valid, float("-inf"))
    return LogprobsTensors(ids, values, token_ranks(log_probs, sampled), cu_num_logits)
