"""The vLLM versions the plugin names (vexact_vllm/versions.py), its start-up note, and the README's
versions table, which must say the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vexact_vllm import versions

README = Path(__file__).resolve().parents[2] / "README.md"


def test_no_note_where_the_plugin_has_been_run():
    assert versions.version_note("0.26.0") is None
    assert versions.version_note("0.32.0") is None
    assert versions.version_note("0.32.0+cpu") is None


def test_the_note_says_what_was_checked():
    checked = versions.version_note("0.33.0")
    assert "installed vLLM is 0.33.0: its sources were checked" in checked
    assert "it has not been run" in checked and "0.26.0 on NVIDIA GPU" in checked
    unknown = versions.version_note("0.34.1")
    assert "installed vLLM is 0.34.1: it has been neither run nor checked" in unknown
    assert "vexact-vllm check" in unknown


@pytest.mark.vllm
def test_the_note_is_logged_once_per_process(monkeypatch):
    import vllm
    import vllm.logger

    logged = []
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(vllm.logger, "init_logger", lambda name: type("L", (), {"warning": logged.append})())
    monkeypatch.setattr(versions, "_noted", False)
    versions.note_version()
    versions.note_version()
    assert logged == [versions.version_note("0.33.0")]


def test_the_readme_versions_table_names_every_version():
    text = README.read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `?(?:vllm(?:-cpu)?==)?(0\.\d+\.\d+)`? \|.*$", text, re.M)}
    for version in versions.RUN_ON:
        assert version in rows, f"the README's versions table has no row for vLLM {version}"
        assert "run" in rows[version] and "not yet run" not in rows[version], rows[version]
    for version in versions.SOURCES_CHECKED:
        assert version in rows, f"the README's versions table has no row for vLLM {version}"
        assert "not yet run" in rows[version], rows[version]
