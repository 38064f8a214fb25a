"""The import structure of kernels/: no cycle between its modules (imports inside functions count),
no module importing another's `_private` name, and no launcher (`op_triton.py`) importing the op
(`op.py`) that dispatches to it: shared checks live in checks.py, shared rules in neutral modules."""

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
PACKAGE = "vexact_vllm.kernels"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import of a kernels module in `path`, at any depth (functions too):
    `from .x import a` -> ("x", ["a"]); `from . import x` -> ("x", []); absolute spellings alike."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                prefix = base
            elif node.level == 0 and (base == PACKAGE or base.startswith(PACKAGE + ".")):
                prefix = base[len(PACKAGE) + 1 :]
            else:
                continue
            if prefix:
                found.append((prefix.split(".")[0], [a.name for a in node.names]))
            else:  # from . import x, y
                found.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.append((alias.name[len(PACKAGE) + 1 :].split(".")[0], []))
    return found


def _modules() -> dict[str, list[tuple[str, list[str]]]]:
    return {p.stem: _imports(p) for p in sorted(KERNELS.glob("*.py"))}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m, _ in deps if m in modules and m != name} for name, deps in modules.items()}


def test_the_graph_sees_function_level_imports():
    graph = _graph()
    assert "logprob_triton" in graph["logprob"]  # imported inside a function (no Triton on CPU)
    assert "settings" in graph["dispatch"]


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_no_private_name_imported_across_modules():
    offenders = [
        f"{name}: from {module} import {imported}"
        for name, deps in _modules().items()
        for module, names in deps
        for imported in names
        if imported.startswith("_")
    ]
    assert not offenders, offenders


def test_no_private_module():
    assert not [p.name for p in KERNELS.glob("_*.py") if p.name != "__init__.py"]


def test_launchers_never_import_their_op():
    """`op.py` dispatches to `op_triton.py`; the launcher takes its checks and rules from neutral
    modules (checks.py, logit_rules.py, gumbel.py, ...), never from the op."""
    graph = _graph()
    pairs = [(name, name.removesuffix("_triton")) for name in graph if name.endswith("_triton")]
    ops = [(launcher, op) for launcher, op in pairs if op in graph and launcher in graph[op]]
    assert ("logprob_triton", "logprob") in ops and ("moe_triton", "moe") in ops
    backwards = [f"{launcher} imports {op}" for launcher, op in ops if op in graph[launcher]]
    assert not backwards, backwards
