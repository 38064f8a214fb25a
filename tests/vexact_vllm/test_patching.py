"""The patch tables (vexact_vllm.patching): the mechanism on fake targets, then every row of the vLLM,
verl and VeOmni tables: its guard fires on a target whose signature differs (with the versions in the
message), and install/uninstall round trips put the exact originals back. Also the vLLM post-condition
"the model vLLM built is ours", on a fake worker."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import sys
import types
from collections.abc import MutableMapping
from types import SimpleNamespace

import pytest

from vexact_vllm import MODEL_IMPL
from vexact_vllm.patching import MISSING, Patch, PatchError, PatchTable, lookup

# --- the mechanism, on a fake library ------------------------------------------------------------


class _Registry(MutableMapping):
    """VeOmni's Registry shape: local overrides over global entries, ValueError for unknown keys."""

    def __init__(self, **entries):
        self.local, self.glob = {}, dict(entries)

    def __getitem__(self, key):
        if key in self.local:
            return self.local[key]
        if key in self.glob:
            return self.glob[key]
        raise ValueError(key)

    def __setitem__(self, key, value):
        self.local[key] = value

    def __delitem__(self, key):
        del self.local[key]

    def __iter__(self):
        return iter({**self.glob, **self.local})

    def __len__(self):
        return len(self.glob.keys() | self.local.keys())


@pytest.fixture
def fakelib(monkeypatch):
    module = types.ModuleType("fakelib")
    module.__version__ = "9.9"

    class Base:
        def inherited(self, x):
            return ("base", x)

    class Engine(Base):
        def step(self, batch, *, eager=False):
            return ("step", batch)

    def helper(a, b=1):
        return a + b

    module.Engine, module.helper, module.registry, module.table = Engine, helper, _Registry(m=helper), {}
    monkeypatch.setitem(sys.modules, "fakelib", module)
    return module


def _tagging(original):
    def replacement(*args, **kwargs):
        return ("patched", original(*args, **kwargs))

    return replacement


def _table(*rows):
    return PatchTable("fakelib", tuple(Patch(t, _tagging, p, "fakelib 1.0") for t, p in rows))


def test_install_uninstall_restores_the_originals(fakelib):
    step, helper, entry = fakelib.Engine.__dict__["step"], fakelib.helper, fakelib.registry["m"]
    table = _table(
        ("fakelib:Engine.step", ("self", "batch", "eager")),
        ("fakelib:Engine.inherited", ("self", "x")),
        ("fakelib:helper", ("a", "b")),
        ("fakelib:registry[m]", ("a", "b")),
    )
    with table.installed():
        assert table.is_installed()
        assert fakelib.Engine().step(3) == ("patched", ("step", 3))
        assert fakelib.Engine().inherited(4) == ("patched", ("base", 4))
        assert fakelib.helper(1) == ("patched", 2) and fakelib.registry["m"](1) == ("patched", 2)
        assert fakelib.Engine.__dict__["step"].__wrapped__ is step and fakelib.Engine.__dict__["step"]._vexact
        table.install()  # idempotent
        assert fakelib.helper.__wrapped__ is helper
    assert not table.is_installed()
    assert fakelib.Engine.__dict__["step"] is step and fakelib.helper is helper
    assert "inherited" not in fakelib.Engine.__dict__  # inherited again, not copied onto the class
    assert fakelib.registry["m"] is entry and fakelib.registry.local == {}  # the global entry shows through


def test_signature_guard(fakelib):
    table = _table(("fakelib:Engine.step", ("self", "micro_batch")))
    with pytest.raises(PatchError) as err:
        table.install()
    message = str(err.value)
    assert "fakelib:Engine.step" in message
    assert "its parameters are (self, batch, eager), the patch expects (self, micro_batch)" in message
    assert "written for fakelib 1.0; installed: fakelib 9.9" in message
    assert not table.is_installed() and not hasattr(fakelib.Engine.__dict__["step"], "__wrapped__")


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("fakelib:Engine.gone", "the target does not exist"),
        ("fakelib:Nowhere.step", "fakelib has no Nowhere"),
        ("fakelib:registry[gone]", "the target does not exist"),
        ("fakelib_missing.module:thing", "module fakelib_missing.module cannot be imported"),
    ],
)
def test_missing_target_guard(fakelib, target, problem):
    with pytest.raises(PatchError, match=problem):
        _table((target, ("x",))).install()


def test_a_failing_row_undoes_the_rows_before_it(fakelib):
    helper = fakelib.helper
    table = _table(("fakelib:helper", ("a", "b")), ("fakelib:Engine.step", ("wrong",)))
    with pytest.raises(PatchError):
        table.install()
    assert fakelib.helper is helper and not table.is_installed()


def test_set_item_is_undone_unless_overwritten_since(fakelib):
    table = _table(("fakelib:helper", ("a", "b")))
    fakelib.table.update(kept="original", other="original")
    with table.installed():
        table.set_item(fakelib.table, "kept", "ours")
        table.set_item(fakelib.table, "new", "ours")
        table.set_item(fakelib.table, "other", "ours")
        fakelib.table["other"] = "someone else's"  # a later write by the library stays
        table.set_item(fakelib.table, "kept", "ours again")
    assert fakelib.table == {"kept": "original", "other": "someone else's"}


def test_patching_imports_no_patched_library():
    code = "import sys, vexact_vllm.patching; print(sorted({'vllm', 'verl', 'veomni'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- every row of the real tables -----------------------------------------------------------------


def _vllm_table():
    pytest.importorskip("vllm")
    import vexact_vllm

    vexact_vllm.register()
    from vexact_vllm import vllm_patches

    return vllm_patches.TABLE


def _verl_table():
    pytest.importorskip("verl")
    from vexact_vllm.model_patches.trainers import verl_hooks

    return verl_hooks.PATCHES


def _veomni_table():
    pytest.importorskip("veomni")
    from vexact_vllm.model_patches.trainers import veomni_hooks

    return veomni_hooks.PATCHES


TABLES = {"vllm": _vllm_table, "verl": _verl_table, "veomni": _veomni_table}


def _current(owner, name, is_item):
    return lookup(owner, name) if is_item else vars(owner).get(name, MISSING)


@contextlib.contextmanager
def _swapped(owner, name, is_item, value):
    """Put `value` at the target for the duration; restore the previous state exactly."""
    before = _current(owner, name, is_item)
    local = dict(owner._local_mapping) if hasattr(owner, "_local_mapping") else None
    if is_item:
        owner[name] = value
    else:
        setattr(owner, name, value)
    try:
        yield
    finally:
        if is_item and local is not None:
            owner._local_mapping.clear()
            owner._local_mapping.update(local)
        elif is_item:
            owner[name] = before
        else:
            setattr(owner, name, before)


@contextlib.contextmanager
def _uninstalled(table):
    was = table.is_installed()
    table.uninstall()
    try:
        yield
    finally:
        if was:
            table.install()


@pytest.mark.parametrize("library", sorted(TABLES))
def test_every_row_refuses_a_target_with_another_signature(library):
    table = TABLES[library]()
    version = importlib.import_module(library).__version__

    def other_signature(renamed_argument):
        pass

    with _uninstalled(table):
        originals = {row.target: _current(*table.locate(row)) for row in table.rows}
        for row in table.rows:
            with _swapped(*table.locate(row), other_signature), pytest.raises(PatchError) as err:
                table.install()
            assert {r.target: _current(*table.locate(r)) for r in table.rows} == originals  # all or nothing
            assert not table.is_installed()
            message = str(err.value)
            assert row.target in message
            assert f"its parameters are (renamed_argument), the patch expects ({', '.join(row.params)})" in message
            assert f"written for {row.written_for}; installed: {library} {version}" in message


@pytest.mark.parametrize("library", sorted(TABLES))
def test_round_trip_restores_the_exact_originals(library):
    table = TABLES[library]()
    with _uninstalled(table):
        located = [table.locate(row) for row in table.rows]
        before = [_current(*where) for where in located]
        table.install()
        table.install()
        assert table.is_installed()
        for where, original in zip(located, before):
            replacement = _current(*where)
            assert replacement is not original and replacement.__wrapped__ is original and replacement._vexact
        table.uninstall()
        assert not table.is_installed()
        assert all(_current(*where) is original for where, original in zip(located, before))


# --- the vLLM post-condition: the model vLLM built is ours ---------------------------------------


class _FakeWorker:
    def __init__(self, model_impl, model):
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model_impl=model_impl))
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.loads = 0

    def load_model(self, *, load_dummy_weights=False):
        self.loads += 1


class _VexactStub:
    is_vexact_model = True


@pytest.fixture
def fake_worker_module(monkeypatch):
    module = types.ModuleType("fake_gpu_worker")
    module.Worker = _FakeWorker
    monkeypatch.setitem(sys.modules, "fake_gpu_worker", module)
    return module


def test_post_condition_refuses_a_model_that_is_not_vexact(fake_worker_module):
    pytest.importorskip("vllm")
    import torch

    from vexact_vllm.registry import NotAVexactModelError, wrap_worker_load_model
    from vexact_vllm.vllm_patches import TABLE

    row = next(r for r in TABLE.rows if r.replace is wrap_worker_load_model)
    fake = PatchTable("vllm", (Patch("fake_gpu_worker:Worker.load_model", row.replace, row.params, row.written_for),))
    with fake.installed():
        stock = _FakeWorker(MODEL_IMPL, torch.nn.Linear(2, 2))
        with pytest.raises(NotAVexactModelError, match=r"--model-impl vexact, but vLLM .* built torch\.nn\.modules"):
            stock.load_model()
        assert stock.loads == 1  # checked after vLLM's own load
        for worker in (_FakeWorker(MODEL_IMPL, _VexactStub()), _FakeWorker("auto", torch.nn.Linear(2, 2))):
            worker.load_model(load_dummy_weights=True)
            assert worker.loads == 1


def test_post_condition_is_installed_on_vllms_worker():
    table = _vllm_table()
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    from vexact_vllm.registry import wrap_worker_load_model

    assert any(row.replace is wrap_worker_load_model for row in table.rows)
    assert table.is_installed() and Worker.__dict__["load_model"]._vexact
    assert CPUWorker.load_model is Worker.load_model  # the CPU worker loads through the same method


# --- runner V2 for vexact models on vLLM 0.26 ----------------------------------------------------


@pytest.mark.parametrize(("model_impl", "runner_type", "is_moe", "expected"), [
    (MODEL_IMPL, "generate", True, True),  # 0.26's rule would say V1 (MoE)
    (MODEL_IMPL, "generate", False, True),
    (MODEL_IMPL, "pooling", True, False),
    ("auto", "generate", True, "original"),
    ("vllm", "generate", False, "original"),
])  # fmt: skip
def test_vexact_models_default_to_runner_v2(model_impl, runner_type, is_moe, expected):
    from vexact_vllm.vllm_patches import wrap_default_v2_runner

    calls = []

    def original(self):
        calls.append(self)
        return "original"

    config = SimpleNamespace(model_config=SimpleNamespace(model_impl=model_impl, runner_type=runner_type,
                                                          is_moe=is_moe))  # fmt: skip
    assert wrap_default_v2_runner(original)(config) == expected
    assert calls == ([config] if expected == "original" else [])
    assert wrap_default_v2_runner(original)(SimpleNamespace(model_config=None)) == "original"


def test_runner_v2_row_exactly_where_vllm_has_the_rule():
    table = _vllm_table()
    from vllm.config import VllmConfig

    rows = [r for r in table.rows if r.target.endswith("_is_default_v2_model_runner_model")]
    assert len(rows) == int(hasattr(VllmConfig, "_is_default_v2_model_runner_model"))
