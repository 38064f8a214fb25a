"""Runner v2's real prompt-log-prob path on the GPU, stage by stage against the trainer.

An in-process vLLM engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the worker runs in this process) on
a tiny checkpoint scores prompts with `prompt_logprobs=k`; a recorder around
`prompt_logprobs.prompt_scores` keeps what the runner handed over (the step's hidden rows) and the
logits `compute_logits` gave back. One prompt per `generate` call (its steps' rows are then the
prompt's positions 0 .. P-1 in order, however the scheduler chunks the prefill) and prompts past
one CHUNK_ROWS chunk. Each row is compared with the trainer's
value for the same row, in the order the data flows, and a failure names the first stage that
differs: the runner did not call vexact's `prompt_scores` (vLLM's own log-softmax scored the
prompt); the hidden states; the logits (the lm_head GEMM); the prompt token's log-prob; the top-k
ids, their log-probs and the ranks.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPT_LENGTHS = (37, 1100, 2040)  # one chunk of rows, then two (CHUNK_ROWS = 1024); tiny models hold 2,048


def first_difference(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when equal (`torch.equal`), else where the first element differs and by how much."""
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} against the trainer's {tuple(want.shape)}"
    if torch.equal(got, want):
        return None
    bad = torch.nonzero(got != want)
    row = tuple(bad[0].tolist())
    diff = (got.double() - want.double()).abs().max().item()
    return (f"{name}: {bad.shape[0]} of {got.numel()} elements differ, first at {row} "
            f"({got[row].item()!r} against {want[row].item()!r}), max |diff| {diff:.3g}")  # fmt: skip


@pytest.mark.parametrize(("arch", "k"), [("qwen3", 5), ("qwen3_moe", 5), ("deepseek_v3", 3)])
def test_runner_v2_prompt_rows_equal_the_trainers_stage_by_stage(tiny_model, monkeypatch, arch, k):
    from vllm import LLM, SamplingParams

    from vexact_vllm import MODEL_IMPL
    from vexact_vllm.cli.score import load_trainer
    from vexact_vllm.kernels import linear, log_softmax, score_tokens
    from vexact_vllm.model_patches import PackedBatch
    from vexact_vllm.sampler import prompt_logprobs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    records = []
    real = prompt_logprobs.prompt_scores

    def recording(tokens, hidden, logits_fn, num_prompt_logprobs, logprobs_mode="raw_logprobs"):
        seen = []

        def logits_fn_recorded(h):
            logits = logits_fn(h)
            seen.append(logits.clone())
            return logits

        out = real(tokens, hidden, logits_fn_recorded, num_prompt_logprobs, logprobs_mode)
        records.append((hidden.clone(), torch.cat(seen), tuple(t.clone() for t in out)))
        return out

    monkeypatch.setattr(prompt_logprobs, "prompt_scores", recording)
    path = tiny_model(arch)
    # 15% of the GPU an engine: the in-process engines of earlier cases keep their memory
    llm = LLM(model=path, model_impl=MODEL_IMPL, dtype="bfloat16", max_model_len=2048, block_size=64,
              max_num_batched_tokens=2048, gpu_memory_utilization=0.15, enable_prefix_caching=False,
              seed=0)  # fmt: skip
    vocab = llm.llm_engine.model_config.get_vocab_size()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    outputs, steps = [], []
    for prompt in prompts:  # one prompt per generate call: its steps' rows are its positions in order
        params = SamplingParams(max_tokens=1, prompt_logprobs=k, seed=1)
        before = len(records)
        outputs.append(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0])
        steps.append(records[before:])
        assert steps[-1], (
            f"runner v2 never called vexact's prompt_scores for a prompt of {len(prompt)} tokens: vLLM's own "
            "compute_prompt_logprobs_with_chunking scored it (the patch row is missing)"
        )
    del llm
    torch.cuda.empty_cache()

    model = load_trainer(path, torch.bfloat16, torch.device("cuda"))
    weight = model.lm_head.weight
    with torch.no_grad():
        for prompt, output, recorded in zip(prompts, outputs, steps):
            n = len(prompt)  # a prompt prefilled in several steps: their rows concatenated
            hidden, logits = (torch.cat([r[i] for r in recorded]) for i in (0, 1))
            ids, values, ranks = (torch.cat([r[2][i] for r in recorded]) for i in range(3))
            batch = PackedBatch.from_sequences([prompt], device=weight.device)
            want_hidden = model.hidden_states(batch)  # [P, H]
            want_logits = torch.cat([linear(want_hidden[r : r + prompt_logprobs.CHUNK_ROWS], weight,
                                            out_dtype=torch.float32)
                                     for r in range(0, n, prompt_logprobs.CHUNK_ROWS)])  # fmt: skip
            token_lp = model.packed_log_probs(batch, 1.0)[: n - 1]  # row t scores token t + 1
            targets = torch.tensor(prompt[1:], device=weight.device)
            want = score_tokens(log_softmax(want_logits[: n - 1], 1.0), targets, k)
            got_values = torch.tensor([[lp.logprob for lp in d.values()][0] for d in output.prompt_logprobs[1:]])
            stages = [
                ("hidden states", hidden[:n], want_hidden),
                ("logits (lm_head GEMM)", logits[:n], want_logits),
                ("prompt token log-prob (the runner's rows)", values[: n - 1, 0], token_lp),
                ("prompt token log-prob (as vLLM returned it)", got_values.to(token_lp.device), token_lp),
                ("top-k ids", ids[: n - 1], want.ids),
                ("top-k log-probs", values[: n - 1], want.log_probs),
                ("ranks", ranks[: n - 1], want.ranks),
            ]
            for name, got, exp in stages:
                problem = first_difference(name, got.to(exp.device), exp)
                assert problem is None, f"{arch}, prompt of {n} tokens: first stage that differs: {problem}"
