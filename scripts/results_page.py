"""Write docs/results.md from docs/results.jsonl: the current figures, one section per row, and the
rollout-throughput chart docs/images/throughput.png.

    python scripts/results_page.py            # writes docs/results.md and the chart (needs matplotlib)
    python scripts/results_page.py --check    # exit 1 if the page or the chart is not the data file's

The data file holds one JSON object a line. Every row has the fields of REQUIRED; `spread` and
`notes` are optional. A row's `id` is a lowercase slug (letters, digits, hyphens): the page gives it
its own `###` heading, so GitHub's anchor for it is the id itself and README and code comments link
`docs/results.md#<id>`. A figure that changes replaces its row; the history is git's.

The chart draws every row of CHART_SECTIONS whose value is a ratio ("0.937x"): vexact's output tok/s
over stock's, per shape, workload and device, with each pair's, run's or launch's own ratio beside it
where the row's spread lists them. The page names the digest of what the chart draws, and the PNG
carries the same digest in its metadata, so `--check` (without matplotlib) finds a chart drawn from
older data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "results.jsonl"
PAGE = ROOT / "docs" / "results.md"
CHART = ROOT / "docs" / "images" / "throughput.png"
CHART_LINK = "images/throughput.png"  # from docs/results.md
# Sections whose ratio rows the chart draws: vexact against stock, each on its own hardware and parallelism.
CHART_SECTIONS = (
    "Rollout throughput, one H200", "Rollout throughput, one H100", "Rollout throughput, tensor parallel",
    "Mixture of experts",
)  # fmt: skip
RATIO = re.compile(r"(\d+\.\d+)x\b")
RUN_RATIO = re.compile(r"(?<![\d.,])(\d\.\d+)(?![\d%])")  # 0.968, not 0.5% nor 13,567
CHART_KEY = "results_page chart"  # the PNG text chunk's keyword
REQUIRED = ("id", "section", "title", "date", "device", "commit", "command", "metric", "value")
OPTIONAL = ("spread", "notes")
ID_PATTERN = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def load_rows(path: Path = DATA) -> list[dict]:
    """The data file's rows, checked: required fields, known fields, unique slug ids."""
    rows, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        where = f"{path.name} line {number}"
        missing = [k for k in REQUIRED if not str(row.get(k, "")).strip()]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        unknown = set(row) - set(REQUIRED) - set(OPTIONAL)
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        if not ID_PATTERN.fullmatch(row["id"]):
            raise ValueError(f"{where}: id {row['id']!r} is not a lowercase slug")
        if row["id"] in seen:
            raise ValueError(f"{where}: id {row['id']!r} twice")
        seen.add(row["id"])
        rows.append(row)
    return rows


class Point(NamedTuple):
    """One row of the chart: a label, its device, the row's ratio, each pair's / run's ratio."""

    id: str
    label: str
    device: str
    value: float
    runs: list[float]


def run_ratios(spread: str | None) -> list[float]:
    """The per-pair, per-run or per-launch ratios a spread lists ("pairs 0.941 0.932", "launches 0.968
    (stock first) and 0.947 ..."), read up to its first ';' (what follows, tok/s and % spreads of each
    side, are not ratios); [] for "one run, no spread" or a spread of tok/s alone."""
    if not spread:
        return []
    return [float(x) for x in RUN_RATIO.findall(spread.split(";")[0])]


def chart_points(rows: list[dict]) -> list[Point]:
    """The chart's rows, in the data file's order: CHART_SECTIONS' rows whose value is a ratio."""
    points = []
    for row in rows:
        ratio = RATIO.match(row["value"].strip())
        if row["section"] not in CHART_SECTIONS or not ratio:
            continue
        device = next(iter(re.findall(r"H100|H200", row["device"])), row["device"])
        label = row["title"].replace("`", "").replace(" shape", "").replace(" workload", "")
        points.append(Point(row["id"], f"{label} ({device})", device, float(ratio.group(1)), run_ratios(row.get("spread"))))
    return points


def chart_digest(points: list[Point]) -> str:
    """What the chart draws, as 16 hex digits."""
    return hashlib.sha256(json.dumps([p._asdict() for p in points]).encode()).hexdigest()[:16]


def draw_chart(points: list[Point], path: Path = CHART) -> None:
    """A dot per row (its ratio), small dots for its pairs / runs, a line at stock (1.0); the digest
    in the PNG's metadata."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"H200": "tab:blue", "H100": "tab:orange"}
    fig, ax = plt.subplots(figsize=(8.5, 0.32 * len(points) + 1.4))
    ys = list(range(len(points)))[::-1]  # the data file's first row at the top
    for y, p in zip(ys, points):
        colour = colours.get(p.device, "tab:gray")
        ax.scatter(p.runs, [y] * len(p.runs), s=14, color=colour, alpha=0.45, zorder=2)
        ax.scatter([p.value], [y], s=46, color=colour, zorder=3)
        ax.text(1.01, y, f"{p.value:g}x", transform=ax.get_yaxis_transform(), va="center", fontsize=7.5)
    ax.axvline(1.0, color="0.3", lw=1, ls="--", zorder=1)
    ax.set_yticks(ys, [p.label for p in points], fontsize=7.5)
    lo = min([p.value for p in points] + [r for p in points for r in p.runs])
    hi = max([p.value for p in points] + [r for p in points for r in p.runs])
    ax.set_xlim(min(0.6, lo - 0.03), max(1.25, hi + 0.05))
    ax.set_xlabel("output tok/s, vexact / stock vLLM (1.0 = stock; big dot: the row's figure, small: its pairs or runs)", fontsize=8)
    ax.set_title("Rollout throughput against stock vLLM, bitwise-exact rollouts (docs/results.md)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    for device, colour in colours.items():
        ax.scatter([], [], color=colour, label=device)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Description": f"{CHART_KEY} {chart_digest(points)}"})
    plt.close(fig)


def png_texts(path: Path) -> dict[str, str]:
    """A PNG's tEXt / zTXt chunks, keyword -> text (the standard library's struct and zlib only)."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    texts, at = {}, 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            texts[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        at += 12 + length
    return texts


def chart_is_current(points: list[Point], path: Path = CHART) -> bool:
    """Whether the PNG at `path` was drawn from `points` (its metadata's digest)."""
    return path.is_file() and png_texts(path).get("Description") == f"{CHART_KEY} {chart_digest(points)}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def render(rows: list[dict]) -> str:
    """The page: a contents table (id, what, value), then each section's rows under their ids."""
    sections: dict[str, list[dict]] = {}
    for row in rows:
        sections.setdefault(row["section"], []).append(row)
    taken = {github_anchor("Results"), github_anchor("Contents")} | {github_anchor(s) for s in sections}
    clash = taken & {row["id"] for row in rows}
    if clash:
        raise ValueError(f"ids equal to a heading's anchor: {sorted(clash)}")
    out = [
        "# Results",
        "",
        "The project's current figures, one section per row of [results.jsonl](results.jsonl) (date, "
        "device, commit, command, value). This page is generated: edit the data file, then run "
        "`python scripts/results_page.py`. A figure that changes replaces its row; git keeps the history.",
        "",
        f"![Rollout throughput, vexact / stock vLLM, per shape, workload and device]({CHART_LINK})",
        "",
        "Rollout throughput against stock vLLM: every row of the sections "
        + ", ".join(f"*{s}*" for s in CHART_SECTIONS)
        + " whose figure is a ratio, with its pairs or runs where the row lists them; drawn by the same "
        f"script. <!-- chart digest {chart_digest(chart_points(rows))} -->",
        "",
        "## Contents",
        "",
    ]
    for section, members in sections.items():
        out += [f"**{section}**", "", "| id | what | value |", "| --- | --- | --- |"]
        out += [f"| [{r['id']}](#{r['id']}) | {_cell(r['title'])} | {_cell(r['value'])} |" for r in members]
        out.append("")
    for section, members in sections.items():
        out += [f"## {section}", ""]
        for r in members:
            out += [f"### {r['id']}", "", f"**{r['title']}**: {r['value']} ({r['metric']})", ""]
            if r.get("spread"):
                out.append(f"- spread: {r['spread']}")
            out.append(f"- device: {r['device']}; date: {r['date']}; commit: {r['commit']}")
            out.append(f"- command: `{r['command']}`")
            if r.get("notes"):
                out.append(f"- notes: {r['notes']}")
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare docs/results.md with the data file's page")
    args = parser.parse_args(argv)
    rows = load_rows(DATA)
    page, points = render(rows), chart_points(rows)
    if args.check:
        stale = [PAGE] if PAGE.read_text() != page else []
        stale += [] if chart_is_current(points) else [CHART]
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python scripts/results_page.py (the chart needs "
                  "matplotlib: pip install -e '.[plot]')", file=sys.stderr)  # fmt: skip
        return 1 if stale else 0
    PAGE.write_text(page)
    if not chart_is_current(points):
        draw_chart(points)
    return 0


if __name__ == "__main__":
    sys.exit(main())
