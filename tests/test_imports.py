"""The import structure of the installed package: `vexact_vllm` with `vexact_vllm.kernels` and
`vexact_vllm.model_patches` and every sub-package `pyproject.toml` installs.

Checked:
- imports run one way: no cycle between modules, imports inside functions included;
- no module imports another's `_private` name;
- no kernel launcher (`op_triton.py`, `op_triton_bwd.py`) imports the op (`op.py`) that dispatches to
  it: shared checks live in checks modules, shared rules in neutral modules;
- every folder of the package that holds Python files is a package `pyproject.toml` installs.

The graph, at module granularity: a node per module, a package standing for its `__init__.py`. An
edge for every import at any depth (functions too), relative or absolute, and for
`importlib.import_module` of a name the code spells (a string, or an f-string over `__package__` /
`__name__`). A module found by a name computed from data is a table's late binding, like vLLM
finding our model class by its name, and is not an edge: `families.Family.load` (a family file by
its table row), `trainers.switch` (the hooks of each trainer library) and `attention.causal`'s
dispatch tables (a launcher by its module name).

A package's `__init__` re-exports names. A name imported from a package is an import of the module
that defines it (followed through the `__init__`'s `from .x import name` lines and its lazy
`_EXPORTS` table), not of every module the `__init__` imports: so a package's `__init__` importing
its modules is no cycle by itself, and `from vexact_vllm.kernels import linear` depends on the
GEMM's module alone, while a name an `__init__` defines itself (`vexact_vllm.__version__`) is an
import of the `__init__`. Importing a module runs its parents' `__init__`s too; those edges are
left out for the same reason (each `__init__`'s own imports are edges of its node).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP = "vexact_vllm"


@cache
def _packages() -> dict[str, Path]:
    """Installed package -> its folder, from pyproject.toml's `[tool.setuptools]` (a package under a
    mapped one lives in the mapped folder, as setuptools finds it)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setup.get("package-dir", {})

    def folder(name: str) -> Path:
        if name in mapped:
            return ROOT / mapped[name]
        parent, _, leaf = name.rpartition(".")
        return folder(parent) / leaf if parent else ROOT / name

    return {name: folder(name) for name in setup["packages"]}


@cache
def _modules() -> dict[str, Path]:
    """Module name -> file; a package's name -> its `__init__.py`."""
    found = {}
    for package, folder in _packages().items():
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


@cache
def _tree(name: str) -> ast.Module:
    path = _modules()[name]
    return ast.parse(path.read_text(), str(path))


def _package_of(name: str) -> str:
    """The package a module's relative imports start from (a package's own name for its `__init__`)."""
    return name if name in _packages() else name.rpartition(".")[0]


def _absolute(name: str, module: str | None, level: int) -> str:
    """The absolute name of `from <level dots><module> import ...` written in module `name`."""
    if not level:
        return module or ""
    base = _package_of(name)
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{module}" if module else base


@cache
def _reexports(package: str) -> dict[str, tuple[str, str]]:
    """Name -> (module, name there) for every name the package's `__init__` takes from elsewhere: its
    top-level `from x import name [as alias]` lines and its lazy `_EXPORTS = {name: ".module"}`."""
    found = {}
    for node in _tree(package).body:
        if isinstance(node, ast.ImportFrom):
            source = _absolute(package, node.module, node.level)
            found.update({a.asname or a.name: (source, a.name) for a in node.names})
        elif (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["_EXPORTS"]
            and isinstance(node.value, ast.Dict)
        ):
            for key, value in zip(node.value.keys, node.value.values):
                relative = value.value
                source = _absolute(package, relative.lstrip("."), len(relative) - len(relative.lstrip(".")))
                found[key.value] = (source, key.value)
    return found


def _defining_module(source: str, name: str) -> str | None:
    """The module that `from source import name` depends on, as Python finds the name: a package's
    re-export (followed to the module that defines it), else the submodule `source.name`, else
    `source` itself; None outside the package."""
    modules = _modules()
    if source in _packages() and name in _reexports(source):
        return _defining_module(*_reexports(source)[name])
    if f"{source}.{name}" in modules:
        return f"{source}.{name}"
    return source if source in modules else None


def _spelled_module(name: str, call: ast.Call) -> list[str]:
    """The modules an `importlib.import_module(...)` call in module `name` may import."""
    if not call.args:
        return []
    arg, known = call.args[0], {"__package__": _package_of(name), "__name__": name}
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text, complete = arg.value, True
    elif isinstance(arg, ast.JoinedStr):
        text, complete = "", True
        for part in arg.values:
            if isinstance(part, ast.Constant):
                text += part.value
            elif isinstance(part.value, ast.Name) and part.value.id in known:
                text += known[part.value.id]
            else:
                complete = False
                break
    else:
        return []
    if text.startswith("."):  # relative to the call's package argument (this module's package here)
        dots = len(text) - len(text.lstrip("."))
        text = _absolute(name, text[dots:], dots)
    return [text] if complete and text in _modules() else []


@cache
def _imports(name: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(module, names) of every import of a package module in module `name`, at any depth:
    `from .x import a, b` -> one entry per module a name resolves to; `import a.b` -> ("a.b", ())."""
    found = []
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(name, node.module, node.level)
            for alias in node.names:
                target = _defining_module(source, alias.name)
                if target is not None:
                    found.append((target, () if target == f"{source}.{alias.name}" else (alias.name,)))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names if alias.name in _modules())
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and getattr(node.func.value, "id", None) == "importlib"
        ):
            found.extend((target, ()) for target in _spelled_module(name, node))
    return tuple(found)


@cache
def _graph() -> dict[str, frozenset[str]]:
    return {name: frozenset(m for m, _ in _imports(name) if m != name) for name in _modules()}


def import_cycles() -> list[str]:
    """One cycle per strongly connected component of the import graph (Tarjan), as
    'a -> b -> a', sorted."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                connect(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for name in sorted(graph):
        if name not in index:
            connect(name)
    return sorted(_cycle_through(graph, component) for component in components)


def _cycle_through(graph: dict[str, frozenset[str]], component: set[str]) -> str:
    """A shortest cycle through the component's first member (breadth-first, inside the component)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for dep in sorted(graph[node] & component):
                if dep == start:
                    cycle = [*paths[node], start]
                    rest = "" if len(component) == len(cycle) - 1 else f" (component: {', '.join(sorted(component))})"
                    return " -> ".join(cycle) + rest
                if dep not in paths:
                    paths[dep] = [*paths[node], dep]
                    following.append(dep)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def test_every_folder_is_an_installed_package():
    """A folder of Python files under an installed package that pyproject.toml does not list would be
    missing from a non-editable install."""
    listed = {folder.resolve() for folder in _packages().values()}
    roots = [ROOT / TOP, ROOT / "kernels", ROOT / "model_patches"]
    folders = {p.parent.resolve() for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    assert not sorted(map(str, folders - listed))
    assert all((folder / "__init__.py").exists() for folder in listed)


def test_the_graph_sees_every_kind_of_import():
    graph = _graph()
    kernels = f"{TOP}.kernels"
    # Imported inside a function (no Triton on CPU).
    assert f"{kernels}.sampling.logprob_triton" in graph[f"{kernels}.sampling.logprob"]
    # Relative, from the top of the kernels into a family, and from a family up to the top.
    assert f"{kernels}.settings" in graph[f"{kernels}.dispatch"]
    assert f"{kernels}.dispatch" in graph[f"{kernels}.moe.routing"]
    assert f"{kernels}.sampling.logprob" in graph[f"{kernels}.moe.routing"]
    # A re-exported name: the defining module, not the package's __init__.
    assert f"{kernels}.gemm.linear" in graph[f"{TOP}.model_patches.layers"]
    assert kernels not in graph[f"{TOP}.model_patches.layers"]
    assert f"{TOP}.model_impl" in graph[f"{TOP}.registry"]
    # A lazy re-export (model_patches' `_EXPORTS`).
    assert _defining_module(f"{TOP}.model_patches", "enable") == f"{TOP}.model_patches.trainers.switch"
    # `importlib.import_module` of a spelled name, not of a computed one.
    causal = f"{kernels}.attention.causal"
    spelled = ast.parse('importlib.import_module(".varlen_triton", __package__)').body[0].value
    computed = ast.parse('importlib.import_module(f".{module}", __package__)').body[0].value
    assert _spelled_module(causal, spelled) == [f"{kernels}.attention.varlen_triton"]
    assert _spelled_module(causal, computed) == []
    # A package's __init__ imports what it re-exports, and runs `register()`'s imports.
    assert f"{kernels}.sampling.sample" in graph[kernels]
    assert f"{TOP}.vllm_patches" in graph[TOP]


def test_no_import_cycle():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_imported_across_modules():
    offenders = [
        f"{name}: from {module} import {imported}"
        for name in _modules()
        for module, names in _imports(name)
        for imported in names
        if imported.startswith("_") and not imported.startswith("__")
    ]
    assert not offenders, offenders


def test_no_private_module():
    private = [name for name in _modules() if name.rpartition(".")[2].startswith("_")]
    assert not [name for name in private if name.rpartition(".")[2] not in ("__init__", "__main__")]


def _ops_above(launcher: str) -> set[str]:
    """The ops of a Triton module's family that sit above it: every module of its package that
    dispatches (imports `dispatch`: an `op.py`), and every other non-Triton module that imports it
    (for `x_triton_bwd`, that imports `x_triton`)."""
    graph, package = _graph(), launcher.rpartition(".")[0]
    forward = launcher.removesuffix("_bwd")
    siblings = [m for m in graph if m.rpartition(".")[0] == package and not m.endswith(("_triton", "_triton_bwd"))]
    return {m for m in siblings if f"{TOP}.kernels.dispatch" in graph[m] or forward in graph[m]}


def test_launchers_never_import_their_op():
    """`op.py` dispatches to `op_triton.py` (and its backward `op_triton_bwd.py`); the launchers take
    their checks and rules from neutral modules (checks.py, logit_rules.py, gumbel.py, ...), never
    from an op of their family (another family's they may call: the fused log-prob calls the GEMM)."""
    graph, kernels = _graph(), f"{TOP}.kernels"
    launchers = {name: _ops_above(name) for name in graph if name.endswith(("_triton", "_triton_bwd"))}
    assert f"{kernels}.sampling.logprob" in launchers[f"{kernels}.sampling.logprob_triton"]
    assert f"{kernels}.moe.experts" in launchers[f"{kernels}.moe.experts_triton_bwd"]
    assert f"{kernels}.attention.causal" in launchers[f"{kernels}.attention.varlen_triton"]
    assert f"{kernels}.sampling.gumbel" not in launchers[f"{kernels}.sampling.gumbel_triton"]  # its rules
    backwards = [f"{name} imports {op}" for name, ops in launchers.items() for op in sorted(ops & graph[name])]
    assert not backwards, backwards
