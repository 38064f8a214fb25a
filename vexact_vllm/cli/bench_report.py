"""`vexact-vllm bench`'s numbers: one repeat's table, the summary over repeats, and a markdown report.

A run record is what one configuration's process measured (`config`, `repeat`, `startup_s`,
`output_tok_s`, ...) or, when it failed, `config`, `repeat` and `failed`. The summary gives, per
configuration, the median output tok/s over its runs with min, max and spread (max/min - 1), the
median start-up, the ratios of medians to stock, and the ratio of each run to the stock run of the
same repeat (min..max: the two ran back to back on the same host), and the pass drift: the timed
passes of all its runs in run order, the mean of the later half over the mean of the earlier half,
minus 1 (with --interleave one engine serves every run, so this is how its speed moves over its life).
"""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

COLUMNS = ("configuration", "runs", "start-up s", "vs stock", "tok/s median", "min", "max", "spread", "vs stock",
           "per repeat", "vs BI", "drift")  # fmt: skip
WIDTHS = (24, 5, 11, 9, 13, 8, 8, 7, 9, 13, 7, 7)
LEGEND = ("runs: runs that finished (of those started); start-up s and tok/s: medians over the runs; "
          "spread: max/min - 1; vs stock: this median / stock's; per repeat: each run / the stock run of the "
          "same repeat (min..max); vs BI: vexact / stock-batch-invariant medians; drift: the later half of its "
          "timed passes (in run order) against the earlier half, in pass time")  # fmt: skip


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def to_table(results: list[dict]) -> str:
    """One repeat's runs: start-up and throughput per configuration, with their ratios to stock (and
    vexact's to stock-batch-invariant). A configuration that failed has `failed` set and no numbers."""
    ok = {r["config"]: r for r in results if not r.get("failed")}
    base, bi = ok.get("stock", {}), ok.get("stock-batch-invariant", {})
    header = (f"{'configuration':24s} {'start-up s':>10s} {'vs stock':>9s} {'output tok/s':>13s} {'vs stock':>9s} "
              f"{'vs BI':>7s}")  # fmt: skip
    lines = [header]
    for r in results:
        if r.get("failed"):
            lines.append(f"{r['config']:24s} failed: {r['failed']}")
            continue
        vs_bi = _ratio(r["output_tok_s"], bi.get("output_tok_s")) if r["config"] == "vexact" else ""
        lines.append(
            f"{r['config']:24s} {r['startup_s']:10.1f} {_ratio(r['startup_s'], base.get('startup_s')):>9s} "
            f"{r['output_tok_s']:13.0f} {_ratio(r['output_tok_s'], base.get('output_tok_s')):>9s} {vs_bi:>7s}".rstrip()
        )
    return "\n".join(lines)


def summarize(results: list[dict]) -> list[dict]:
    """One row per configuration (in the order they first ran) from every run record."""
    names = list(dict.fromkeys(r["config"] for r in results))
    rows = []
    for name in names:
        runs = [r for r in results if r["config"] == name]
        ok = [r for r in runs if not r.get("failed")]
        row = {"config": name, "runs": len(ok), "started": len(runs),
               "failed": [f"repeat {r.get('repeat', '?')}: {r['failed']}" for r in runs if r.get("failed")]}  # fmt: skip
        if ok:
            tok = [r["output_tok_s"] for r in ok]
            row.update(tok_s_median=statistics.median(tok), tok_s_min=min(tok), tok_s_max=max(tok),
                       spread=max(tok) / min(tok) - 1, startup_s_median=statistics.median(r["startup_s"] for r in ok),
                       tok_s_by_repeat={r.get("repeat"): r["output_tok_s"] for r in ok},
                       pass_drift=pass_drift(ok))  # fmt: skip
        rows.append(row)
    ok_rows = {row["config"]: row for row in rows if row["runs"]}
    stock, bi = ok_rows.get("stock", {}), ok_rows.get("stock-batch-invariant", {})
    for row in ok_rows.values():
        row["tok_s_vs_stock"] = _div(row["tok_s_median"], stock.get("tok_s_median"))
        row["startup_vs_stock"] = _div(row["startup_s_median"], stock.get("startup_s_median"))
        if row["config"] != "stock":
            by_stock = stock.get("tok_s_by_repeat", {})
            row["per_repeat_vs_stock"] = [tok / by_stock[rep] for rep, tok in row["tok_s_by_repeat"].items()
                                          if rep in by_stock]  # fmt: skip
        if row["config"] == "vexact":
            row["vs_bi"] = _div(row["tok_s_median"], bi.get("tok_s_median"))
    return rows


def pass_drift(runs: list[dict]) -> float | None:
    """Mean time of the later half of the runs' timed passes (in run order: `position` where recorded)
    over the earlier half's, minus 1; None with fewer than two passes."""
    ordered = sorted(runs, key=lambda r: r.get("position", 0))
    times = [t for r in ordered for t in r.get("pass_s", [])]
    half = len(times) // 2
    if half == 0:
        return None
    return statistics.fmean(times[-half:]) / statistics.fmean(times[:half]) - 1


def _div(a: float, b: float | None) -> float | None:
    return a / b if b else None


def _cells(row: dict, sep: str = "") -> list[str]:
    """The table cells of one summary row; `sep` groups thousands (the markdown report uses ",")."""
    runs = str(row["runs"]) if row["runs"] == row["started"] else f"{row['runs']}/{row['started']}"
    if not row["runs"]:
        return [row["config"], runs, f"failed: {row['failed'][0]}"]
    fmt = f"{{:{sep}.0f}}"
    paired = row.get("per_repeat_vs_stock") or []
    return [
        row["config"], runs, f"{row['startup_s_median']:.1f}", _num(row["startup_vs_stock"]),
        fmt.format(row["tok_s_median"]), fmt.format(row["tok_s_min"]), fmt.format(row["tok_s_max"]),
        f"{100 * row['spread']:.1f}%", _num(row["tok_s_vs_stock"]),
        f"{min(paired):.3f}..{max(paired):.3f}" if paired else "-", _num(row.get("vs_bi")),
        "-" if row.get("pass_drift") is None else f"{100 * row['pass_drift']:+.1f}%",
    ]  # fmt: skip


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _failures(rows: list[dict]) -> list[str]:
    return [f"{row['config']}: run of {f}" for row in rows for f in row["failed"] if row["runs"]]


def summary_table(rows: list[dict]) -> str:
    """The plain-text table the command prints last."""
    header = " ".join(f"{c:{'<' if i == 0 else '>'}{w}s}" for i, (c, w) in enumerate(zip(COLUMNS, WIDTHS)))
    lines = [header]
    for row in rows:
        cells = _cells(row)
        if not row["runs"]:
            lines.append(f"{cells[0]:24s} {cells[1]:>5s} {cells[2]}")
            continue
        lines.append(" ".join(f"{c:{'<' if i == 0 else '>'}{w}s}" for i, (c, w) in enumerate(zip(cells, WIDTHS))))
    return "\n".join([*lines, LEGEND, *(f"failed: {f}" for f in _failures(rows))])


def markdown_report(rows: list[dict], meta: dict) -> str:
    """A markdown section for a results page: date, device, commit, command, workload and the table.
    `meta` holds `date`, `device`, `commit`, `command`, `workload` and, optionally, `settings` and
    `engine` (the engine arguments the checkpoint asks for)."""
    head = ["configuration", "runs", "start-up s (median)", "vs stock", "output tok/s (median)", "min", "max",
            "spread", "vs stock", "per repeat vs stock", "vs BI", "pass drift"]  # fmt: skip
    lines = [f"## {meta['date']}: `vexact-vllm bench`, {meta['device']}", "",
             f"Commit: {meta['commit']}. Command: `{meta['command']}`", "", f"Workload: {meta['workload']}.", "",
             *([f"Settings: `{meta['settings']}`.", ""] if meta.get("settings") else []),
             *([f"Engine arguments the checkpoint asks for: `{meta['engine']}`.", ""] if meta.get("engine") else []),
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]  # fmt: skip
    for row in rows:
        cells = _cells(row, sep=",")
        lines.append("| " + " | ".join(cells + ["-"] * (len(head) - len(cells))) + " |")
    lines += ["", LEGEND + ".", *(f"Failed: {f}." for f in _failures(rows))]
    return "\n".join(lines)


def git_commit() -> str:
    """This package's short commit (noting uncommitted changes to tracked files), or "unknown"."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" (with uncommitted changes)" if dirty else "") if commit else "unknown"
