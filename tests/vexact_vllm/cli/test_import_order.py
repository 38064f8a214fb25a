"""The CLI's modules import one way: no module of vexact_vllm/cli imports, at the top or inside a
function, a module that imports it back (directly or through others)."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parents[3] / "vexact_vllm" / "cli"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The sibling modules `path` imports anywhere in it (`from .x import`, `from . import x`,
    `from vexact_vllm.cli.x import`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
        elif node.module and node.module.startswith("vexact_vllm.cli."):
            names = [node.module.split(".")[2]]
        else:
            names = []
        found.update(n for n in names if n in modules and n != path.stem)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_cli_modules_import_one_way():
    modules = {p.stem for p in CLI.glob("*.py")}
    graph = {m: _imports(CLI / f"{m}.py", modules) for m in modules}
    assert {"rollout", "score"} <= graph["check"]  # the finder sees the imports
    assert _cycle(graph) is None, f"import cycle in vexact_vllm/cli: {' -> '.join(_cycle(graph))}"
