"""benchmarks/bench_trainer.py on CPU with the tiny shape: one step per path, a table with every row,
the same seeded weights on both sides, and no full [T, V] logits on the vexact path."""

from __future__ import annotations

import json
import math

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench_trainer")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(bench, tmp_path, capsys, shape, seq_len, stock):
    """One CPU step per path at std 0.3, batch 2: (the printed table, the rows by path)."""
    out = tmp_path / "trainer.json"
    rc = bench.main([
        "--shape", shape, "--device", "cpu", "--batch", "2", "--seq-len", str(seq_len), "--steps", "1",
        "--warmup", "0", "--stock", stock, "--init-std", "0.3", "--json", str(out),
    ])  # fmt: skip
    table = capsys.readouterr().out
    assert rc == 0, table
    return table, {r["path"]: r for r in json.loads(out.read_text())["rows"]}


def test_table_has_both_paths(bench, tmp_path, capsys, one_thread):
    # 2 x 160 = 320 rows: more than the fused log-prob's 256-row chunk, so it must chunk.
    table, rows = _run(bench, tmp_path, capsys, "tiny", 160, "sdpa-padded,sdpa-packed")
    assert list(rows) == ["vexact", "stock-sdpa-padded", "stock-sdpa-packed"]
    t, vocab = 2 * 160, bench.TINY_SHAPE["vocab_size"]
    for name, r in rows.items():
        assert r["tokens_per_s"] > 0 and r["ms_mean"] > 0 and r["vs_stock"] > 0, name
        assert math.isfinite(r["loss"]) and r["loss"] > 0, name
        line = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert float(line.split()[1]) > 0 and float(line.split()[2]) > 0, line
    assert max(r["vs_stock"] for name, r in rows.items() if name != "vexact") == pytest.approx(1.0)
    # The fused log-prob never creates a [T, V] tensor; the stock path does (the check can fire).
    assert rows["vexact"]["full_logits"] is False and 0 < rows["vexact"]["largest_vocab_tensor"] < t * vocab
    assert rows["stock-sdpa-padded"]["full_logits"] is True and rows["stock-sdpa-packed"]["full_logits"] is True
    # Same seeded weights and tokens: the three losses agree to bf16 rounding (~1e-4 relative here).
    # Packed stock that let sequences attend across each other (transformers ignores packed
    # position_ids when given a cache) was 2e-3 off; at std 0.3 the loss is far from log(V) = 6.93.
    assert rows["vexact"]["loss"] > 9
    for name in ("stock-sdpa-padded", "stock-sdpa-packed"):
        assert rows[name]["loss"] == pytest.approx(rows["vexact"]["loss"], rel=5e-4), name


def test_unknown_stock_path_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--device", "cpu", "--stock", "eager-padded"])


def test_moe_shape_same_loss(bench, tmp_path, capsys, one_thread):
    # The Qwen3-MoE shapes build transformers' Qwen3MoeForCausalLM on the stock side; same seeded
    # weights (stacked experts included) give the same loss to bf16 rounding.
    _, rows = _run(bench, tmp_path, capsys, "tiny-moe", 48, "sdpa-packed")
    assert rows["stock-sdpa-packed"]["experts"] in ("eager", "grouped_mm")
    assert rows["vexact"]["loss"] > 9
    assert rows["stock-sdpa-packed"]["loss"] == pytest.approx(rows["vexact"]["loss"], rel=5e-4)


def test_profile_names_where_each_path_spends_its_step(bench, tmp_path, capsys, one_thread):
    """--profile N: each path's N ops with the most self time in one step, largest first, in the table
    and the JSON; each names its own scoring (vexact's fused log-prob, stock's log_softmax)."""
    out = tmp_path / "trainer.json"
    rc = bench.main([
        "--shape", "tiny", "--device", "cpu", "--batch", "2", "--seq-len", "64", "--steps", "1", "--warmup", "0",
        "--stock", "sdpa-padded", "--no-logits-check", "--json", str(out), "--profile", "40",
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("vexact", "stock-sdpa-padded"):
        ops = rows[name]["profile"]
        assert 0 < len(ops) <= 40, ops
        assert [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
        assert all(op["calls"] > 0 and 0 < op["share"] <= 1 for op in ops)
        assert sum(op["share"] for op in ops) <= 1 + 1e-9
        assert f"\n{name}: the ops with the most self time in one step" in printed
    names = {path: {op["op"] for op in rows[path]["profile"]} for path in rows}
    assert "_LinearTokenLogProbsFunction" in names["vexact"] and "aten::_log_softmax" not in names["vexact"]
    assert "aten::_log_softmax" in names["stock-sdpa-padded"], names["stock-sdpa-padded"]


def test_negative_profile_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--device", "cpu", "--profile", "-1"])
