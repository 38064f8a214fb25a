"""The shared model never imports the trainer side: every module of model_patches/ outside trainers/
(models/ included) imports nothing from `vexact_vllm.model_patches.trainers`, absolute or relative.
`enable.py` is the one exception: verl's `external_lib` imports it to turn the trainer side on."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "model_patches"
PACKAGE = "vexact_vllm.model_patches"
TRAINERS = f"{PACKAGE}.trainers"
SHARED = sorted(
    p for p in ROOT.rglob("*.py") if "trainers" not in p.relative_to(ROOT).parts and p.name != "enable.py"
)


def imported_modules(source: str, rel: Path) -> set[str]:
    """Absolute names of what the module at `rel` (a path under model_patches/) imports: for
    `from X import a`, both X and X.a (a may be a submodule)."""
    package = [PACKAGE, *rel.parts[:-1]]  # the package the module belongs to
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _trainer_side(names: set[str]) -> set[str]:
    return {n for n in names if n == TRAINERS or n.startswith(TRAINERS + ".")}


def test_the_shared_model_is_found():
    assert {"families.py", "config.py", "layers.py", "moe.py", "__init__.py"} <= {p.name for p in SHARED}
    assert any(p.parent.name == "models" for p in SHARED)


@pytest.mark.parametrize("path", SHARED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shared_module_never_imports_the_trainer_side(path):
    rel = path.relative_to(ROOT)
    bad = _trainer_side(imported_modules(path.read_text(), rel))
    assert not bad, f"{rel} imports the trainer side: {sorted(bad)}"


@pytest.mark.parametrize(
    "rel, source",
    [
        ("x.py", "from .trainers import switch\n"),
        ("x.py", "from .trainers.switch import enable\n"),
        ("x.py", "from . import trainers\n"),
        ("models/x.py", "from ..trainers.hf_causal_lm import PackedBatch\n"),
        ("models/x.py", "import vexact_vllm.model_patches.trainers.switch\n"),
        ("x.py", "def f():\n    from vexact_vllm.model_patches.trainers import switch\n"),
    ],
)
def test_the_check_catches_every_import_form(rel, source):
    assert _trainer_side(imported_modules(source, Path(rel)))
