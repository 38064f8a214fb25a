"""The check's verdict: a table for people, JSON for machines."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .records import Comparison


@dataclass
class Row:
    composition: str
    engine: str  # "vexact" or "stock"
    packing: str  # training micro-batch sizes compared
    comparison: Comparison
    notes: dict = field(default_factory=dict)
    problem: str | None = None  # the composition did not test what it is for (e.g. no cache hits)
    # Mismatching tokens per trainer packing ("1", "3", "all"): `comparison` is the worst of them.
    # Packings that disagree with each other point at the trainer, not at vLLM.
    per_packing: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.comparison.mismatches == 0 and self.problem is None


def verdict(rows: list[Row]) -> bool:
    """Only vexact rows decide; stock rows are shown for comparison."""
    vexact = [r for r in rows if r.engine == "vexact"]
    return bool(vexact) and all(r.passed for r in vexact)


def to_json(rows: list[Row], meta: dict) -> str:
    def row(r: Row):
        d = asdict(r.comparison)
        d.pop("per_position")
        return {"composition": r.composition, "engine": r.engine, "packing": r.packing, "notes": r.notes,
                "problem": r.problem, "per_packing": r.per_packing, **d}

    return json.dumps({**meta, "passed": verdict(rows), "rows": [row(r) for r in rows]}, indent=2)


def to_table(rows: list[Row]) -> str:
    header = ("engine", "composition", "trainer packing", "tokens", "mismatching", "max |diff|", "first mismatch")
    lines = [header]
    for r in rows:
        c = r.comparison
        first = "-" if c.first is None else c.first.describe()
        name = r.composition + "".join(f" [{k}: {v}]" for k, v in r.notes.items())
        packing = r.packing
        if len(set(r.per_packing.values())) > 1:  # the packings disagree: show each one's count
            packing = ",".join(f"{k}:{v}" for k, v in r.per_packing.items())
        lines.append((r.engine, name, packing, str(c.tokens), str(c.mismatches), f"{c.max_abs_diff:.3g}", first))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    fmt = lambda line: "  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()  # noqa: E731
    out = [fmt(lines[0]), fmt(tuple("-" * w for w in widths))] + [fmt(line) for line in lines[1:]]
    out += [f"FAIL ({r.engine}, {r.composition}): {r.problem}" for r in rows if r.problem]
    out.append("PASS: every token matches bit for bit" if verdict(rows) else "FAIL: see the rows above")
    return "\n".join(out)
