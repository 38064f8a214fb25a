"""Runner v2's prompt log-probs from the one log-prob function (`wrap_prompt_logprobs`, a row of
vllm_patches.py), for vexact models only.

vLLM's `PromptLogprobsWorker.compute_prompt_logprobs` keeps what is vLLM's: which requests of the
step need prompt log-probs, the per-request accumulation over chunked-prefill chunks, and the skip of
a request resumed after preemption (its prompt log-probs were returned before). For the step's rows it
calls the module-level `compute_prompt_logprobs_with_chunking(prompt_token_ids, prompt_hidden_states,
logits_fn, num_prompt_logprobs, logprobs_mode)`, with `logits_fn` the model's `compute_logits`; for a
vexact model that call is `prompt_scores` below, per chunk of CHUNK_ROWS rows (vLLM's own chunk):
    logits    = logits_fn(hidden[rows])               fp32 [c, V]: the lm_head GEMM (all-gathered under TP)
    log_probs = kernels.log_softmax(logits, 1.0)      written over the logits
    scores    = kernels.score_tokens(log_probs, next prompt tokens, k)
Row t scores token t + 1 at temperature 1 (vLLM's prompt log-probs are raw, whatever the request's
temperature): the value the trainer's `packed_log_probs(batch, temperature=1.0)` gives that row, and
the top-k and rank `kernels.score_tokens` gives over the trainer's own log-probs.

Memory: never [prompt_len, V] at once. A chunk holds its fp32 logits, c x V x 4 bytes (622 MB for
1,024 rows at V = 151,936; vLLM's own chunk costs the same), the log-probs written over them, and
with top-k torch.topk's picks and a comparison mask of one row block, and for rows with a tie at the
k-th place the int64 keys of one row block (kernels.sampling.logprob_topk.BLOCK_ELEMENTS: 128 MiB).
"""

from __future__ import annotations

import functools

import torch

from vexact_vllm.kernels import log_softmax, score_tokens
from vexact_vllm.registry import is_vexact_model

CHUNK_ROWS = 1024  # vLLM's CHUNK_SIZE: rows of logits per call of logits_fn
LOGITS_MODES = ("raw_logits", "processed_logits")  # refused for vexact models (option_policy.py)


def prompt_scores(
    prompt_token_ids: torch.Tensor,
    prompt_hidden_states: torch.Tensor,
    logits_fn,
    num_prompt_logprobs: int,
    logprobs_mode: str = "raw_logprobs",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids int64 [N, 1 + k], log-probs fp32 [N, 1 + k], ranks int64 [N]) of the N rows, as vLLM's
    `compute_prompt_logprobs_with_chunking` returns them (k = V for num_prompt_logprobs -1)."""
    if logprobs_mode in LOGITS_MODES:
        raise ValueError(f"--logprobs-mode {logprobs_mode} is not supported with --model-impl vexact")
    tokens = prompt_token_ids.to(torch.int64)
    ids, values, ranks = [], [], []
    for r0 in range(0, tokens.shape[0], CHUNK_ROWS):
        rows = slice(r0, r0 + CHUNK_ROWS)
        logits = logits_fn(prompt_hidden_states[rows])  # fp32 [c, V]
        vocab = logits.shape[1]
        in_place = logits.dtype == torch.float32 and logits.is_contiguous()
        log_probs = log_softmax(logits.float(), 1.0, out=logits if in_place else None)  # [c, V]
        # Rows vLLM drops (a prompt's last row, other requests' decode rows) may name any id; clamped
        # so the gathers stay in bounds. A row it keeps names a prompt token, in range already.
        chunk_tokens = tokens[rows].clamp(0, vocab - 1)
        scores = score_tokens(log_probs, chunk_tokens, vocab if num_prompt_logprobs == -1 else num_prompt_logprobs)
        ids.append(scores.ids)
        values.append(scores.log_probs)
        ranks.append(scores.ranks)
    if len(ids) == 1:
        return ids[0], values[0], ranks[0]
    return torch.cat(ids), torch.cat(values), torch.cat(ranks)


def wrap_prompt_logprobs(original):
    """`vllm.v1.worker.gpu.sample.prompt_logprob.compute_prompt_logprobs_with_chunking` (runner v2;
    a row of vllm_patches.py): `prompt_scores` when `logits_fn` is a vexact model's `compute_logits`,
    vLLM's own function otherwise."""

    @functools.wraps(original)
    def compute_prompt_logprobs_with_chunking(
        prompt_token_ids, prompt_hidden_states, logits_fn, num_prompt_logprobs, logprobs_mode="raw_logprobs"
    ):
        if is_vexact_model(getattr(logits_fn, "__self__", None)):
            return prompt_scores(prompt_token_ids, prompt_hidden_states, logits_fn, num_prompt_logprobs, logprobs_mode)
        return original(prompt_token_ids, prompt_hidden_states, logits_fn, num_prompt_logprobs, logprobs_mode)

    return compute_prompt_logprobs_with_chunking
