"""Every relative link and path the user docs name exists, and the docs state no history labels.

Checked: README.md, examples/README.md and docs/*.md. A markdown link's file must exist (relative to
the document) and its anchor must be a heading of the target (GitHub's anchors; a results row's id is
its heading). A backticked repository path (`kernels/gemm/linear.py`, `examples/verl/`) must exist from the
repository root; a bare directory name with a trailing slash (`models/`) must be a directory somewhere
in the tree. A results row's `command` is what ran at the row's commit, so docs/results.md's command
lines are not read as paths.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "examples" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"(?:\.?[\w-]+/)+(?:[\w.-]+)?")  # a/b, a/b.py, a/ ; no spaces, no scheme
TOP_LEVEL = ("vexact_vllm", "kernels", "model_patches", "examples", "tests", "docs", "benchmarks", "scripts", ".ci")
HISTORY = re.compile(r"sessions? ?[0-9]+|issue ?[0-9]+", re.IGNORECASE)


def _results_page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _without_fences(text: str) -> str:
    """The text outside fenced code blocks (a shell line's `a/b` is not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(path: Path) -> set[str]:
    anchor = _results_page().github_anchor
    return {anchor(line.lstrip("#")) for line in _without_fences(path.read_text()).splitlines() if line.startswith("#")}


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_links_resolve(doc):
    missing = []
    for target in LINK.findall(_without_fences(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            missing.append(f"{target}: no {file_part}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            missing.append(f"{target}: no heading #{anchor} in {_relative(dest)}")
    assert not missing, f"{_relative(doc)}: " + "; ".join(missing)


def _named_paths(doc: Path) -> list[str]:
    """Backticked paths outside code blocks, and top-level paths inside them (`bash scripts/x.sh`)."""
    text = doc.read_text()
    if doc.name == "results.md":
        text = "\n".join(line for line in text.splitlines() if not line.startswith("- command:"))
    prose = _without_fences(text)
    paths = []
    for span in CODE_SPAN.findall(prose):
        span = span.strip()
        if " " in span or not REPO_PATH.fullmatch(span) or span.startswith(("~", "/")):
            continue
        paths.append(span)
    for block in re.findall(r"^```.*?^```", text, flags=re.S | re.M):
        paths += re.findall(rf"(?<![\w./$-])((?:{'|'.join(map(re.escape, TOP_LEVEL))})/[\w./-]*)", block)
    return paths


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_named_paths_exist(doc):
    missing = []
    for path in _named_paths(doc):
        first = path.split("/", 1)[0]
        if first in TOP_LEVEL or (ROOT / first).exists():
            if not (ROOT / path).exists():
                missing.append(path)
        elif path.endswith("/") and path.count("/") == 1:  # a sub-directory named on its own: `models/`
            if not any(p.is_dir() for p in ROOT.glob(f"**/{path.rstrip('/')}") if ".venv" not in p.parts):
                missing.append(path)
    assert not missing, f"{_relative(doc)} names paths that do not exist: {', '.join(sorted(set(missing)))}"


def test_docs_name_real_paths():
    """The checks above see the paths they are meant for (a regression guard on the patterns)."""
    readme_paths = _named_paths(ROOT / "README.md")
    assert {"scripts/install-cpu.sh", "examples/verl/smoke_1gpu.sh", "kernels/"} <= set(readme_paths)
    assert any(p.startswith("kernels/") for p in _named_paths(ROOT / "docs" / "architecture.md"))


def test_docs_named_anywhere_exist():
    """A `docs/<file>` (and `#anchor`) named in any tracked file, code comments included, exists."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named = re.compile(r"docs/([\w.-]+\.(?:md|jsonl))(?:#([\w-]+))?")
    missing = []
    for name in files:
        path = ROOT / name
        if path.suffix not in (".py", ".sh", ".md", ".toml", ".txt", "") or not path.is_file() or "tests/docs" in name:
            continue
        for doc, anchor in named.findall(path.read_text(errors="ignore")):
            target = ROOT / "docs" / doc
            if not target.exists():
                missing.append(f"{name}: docs/{doc}")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                missing.append(f"{name}: docs/{doc}#{anchor}")
    assert not missing, "named but missing: " + "; ".join(sorted(set(missing)))


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "docs" / "results.jsonl"], ids=_relative)
def test_no_history_labels(doc):
    found = sorted({m.group(0) for m in HISTORY.finditer(doc.read_text())})
    assert not found, f"{_relative(doc)} states history labels: {found} (docs state today's facts; git keeps history)"
