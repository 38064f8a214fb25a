"""Write docs/results.md from docs/results.jsonl: the current figures, one section per row.

    python scripts/results_page.py            # writes docs/results.md
    python scripts/results_page.py --check    # exit 1 if docs/results.md is not the data file's page

The data file holds one JSON object a line. Every row has the fields of REQUIRED; `spread` and
`notes` are optional. A row's `id` is a lowercase slug (letters, digits, hyphens): the page gives it
its own `###` heading, so GitHub's anchor for it is the id itself and README and code comments link
`docs/results.md#<id>`. A figure that changes replaces its row; the history is git's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "results.jsonl"
PAGE = ROOT / "docs" / "results.md"
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
    page = render(load_rows(DATA))
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/results_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
