"""Generate with vLLM (`model_impl="vexact"`), score the same tokens with the training forward, and
compare: vLLM's log-prob of every sampled token beside the trainer's, then `torch.equal` of the two.

    python examples/offline.py                                  # the built-in tiny Qwen3, CPU or GPU
    python examples/offline.py --model PATH --prompt "2 + 2 ="  # your checkpoint

The built-in models have random weights: their text reads as noise; the log-probs are what is compared.
Exit status 0 when the two are equal. vLLM needs the `if __name__ == "__main__":` guard below: it
starts its engine in processes of its own, which import this file again.
"""

from __future__ import annotations

import argparse

import torch


def generate(path: str, prompt: str, max_tokens: int, temperature: float, seed: int):
    """(prompt ids, sampled ids, vLLM's log-prob of each sampled token, vLLM's text) of one request."""
    from vllm import LLM, SamplingParams

    # On CPU, vLLM reserves most of the RAM for its KV cache unless told how much to take.
    memory = {} if torch.cuda.is_available() else {"kv_cache_memory_bytes": 256 << 20}
    llm = LLM(path, model_impl="vexact", dtype="bfloat16", max_model_len=1024, **memory)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, logprobs=0)
    out = llm.generate([prompt], params)[0]
    sample = out.outputs[0]
    logprobs = [step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)]
    return list(out.prompt_token_ids), list(sample.token_ids), logprobs, sample.text


def trainer_log_probs(path: str, prompt_ids: list[int], output_ids: list[int], temperature: float) -> torch.Tensor:
    """The trainer's log-prob of each sampled token: the training class, the sequence packed."""
    from transformers import AutoModelForCausalLM

    from vexact_vllm.model_patches import PackedBatch, enable

    enable()  # AutoModelForCausalLM now builds the vexact training class
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where vLLM ran: CPU and GPU kernels differ
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    batch = PackedBatch.from_sequences([prompt_ids + output_ids], device=device)
    with torch.no_grad():
        logp = model.packed_log_probs(batch, temperature=temperature).cpu()  # row t scores token t + 1
    return logp[len(prompt_ids) - 1 : -1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen3", help="checkpoint directory or built-in name (tiny-qwen3)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from vexact_vllm.model_shapes import MODELS_WITH_WEIGHTS
    from vexact_vllm.tiny_model import builtin_model

    path = builtin_model(args.model) if args.model in MODELS_WITH_WEIGHTS else args.model
    prompt_ids, output_ids, vllm_logp, text = generate(path, args.prompt, args.max_tokens, args.temperature, args.seed)
    vllm_logp = torch.tensor(vllm_logp, dtype=torch.float32)  # vLLM's floats are the fp32 values
    trainer_logp = trainer_log_probs(path, prompt_ids, output_ids, args.temperature)

    print(f"prompt {args.prompt!r} -> {text!r}")
    print(f"{'token id':>8}  {'vLLM log-prob':>15}  {'trainer log-prob':>16}")
    for token, v, t in zip(output_ids, vllm_logp.tolist(), trainer_logp.tolist()):
        print(f"{token:>8}  {v:>15.9g}  {t:>16.9g}{'' if v == t else '  <- differs'}")
    equal = torch.equal(vllm_logp, trainer_logp)
    print(f"torch.equal(vLLM, trainer): {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
