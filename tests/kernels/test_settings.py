"""kernels/settings.py: the one reader of the VEXACT_* environment variables (read once, validated)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vexact_vllm.kernels.settings import (
    DEFAULT_KEY_SPLIT,
    ENV_VARS,
    Settings,
    clear_settings,
    get_settings,
    refresh_settings,
    settings_from,
)

ROOT = Path(__file__).resolve().parents[2]
VARIABLES = ("VEXACT_ATTENTION", "VEXACT_KEY_SPLIT", "VEXACT_SHARED_PREFIX", "VEXACT_VLLM_CACHE")


@pytest.fixture
def env(monkeypatch):
    """env(**variables): the VEXACT_* environment set to exactly these (the others removed)."""

    def apply(**variables):
        for name in VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return apply


def test_defaults(env):
    env()
    got = refresh_settings()
    assert got == Settings("triton", DEFAULT_KEY_SPLIT, False, Path.home() / ".cache" / "vexact-vllm")
    assert DEFAULT_KEY_SPLIT == 2048
    assert set(ENV_VARS) == set(VARIABLES)
    line = got.describe()
    assert "\n" not in line and all(name in line for name in VARIABLES)


def test_values(env, tmp_path):
    env(VEXACT_ATTENTION="fa4", VEXACT_VLLM_CACHE=str(tmp_path))
    assert refresh_settings() == Settings("fa4", 0, False, tmp_path)  # fa4 takes no split: 0 when unset
    env(VEXACT_KEY_SPLIT="0", VEXACT_SHARED_PREFIX="1")
    assert refresh_settings().shared_prefix and get_settings().key_split == 0
    env(VEXACT_KEY_SPLIT="1024", VEXACT_ATTENTION="", VEXACT_VLLM_CACHE="~/x")
    got = refresh_settings()
    assert (got.attention, got.key_split, got.cache_dir) == ("triton", 1024, Path.home() / "x")  # "" is unset
    with pytest.raises(AttributeError):
        got.key_split = 0  # frozen


@pytest.mark.parametrize(
    "variables, message",
    [
        (dict(VEXACT_ATTENTION="flash"), "VEXACT_ATTENTION must be one of triton, fa4"),
        (dict(VEXACT_KEY_SPLIT="-64"), "VEXACT_KEY_SPLIT must be 0 .no split. or a positive multiple of 64"),
        (dict(VEXACT_KEY_SPLIT="100"), "VEXACT_KEY_SPLIT must be 0"),
        (dict(VEXACT_KEY_SPLIT="abc"), "VEXACT_KEY_SPLIT must be 0"),
        (dict(VEXACT_KEY_SPLIT="64.0"), "VEXACT_KEY_SPLIT must be 0"),
        (dict(VEXACT_KEY_SPLIT="1024", VEXACT_ATTENTION="fa4"), "VEXACT_ATTENTION=fa4 runs FlashAttention-4, which takes no split"),
        (dict(VEXACT_SHARED_PREFIX="on"), "VEXACT_SHARED_PREFIX must be 0 or 1"),
        (dict(VEXACT_SHARED_PREFIX="1", VEXACT_ATTENTION="fa4"), "FlashAttention-4, which takes no groups"),
        (dict(VEXACT_SHARED_PREFIX="1"), "takes no key split.*set VEXACT_KEY_SPLIT=0 on the trainer and the rollout"),
        (dict(VEXACT_SHARED_PREFIX="1", VEXACT_KEY_SPLIT="512"), "splits keys every 512"),
    ],
)  # fmt: skip
def test_refused(env, variables, message):
    env(**variables)
    with pytest.raises(ValueError, match=message):
        refresh_settings()
    with pytest.raises(ValueError, match=message):
        get_settings()  # refused at every read until fixed


def test_constructor_validates():
    with pytest.raises(ValueError, match="VEXACT_KEY_SPLIT must be 0"):
        Settings(key_split=96)
    assert settings_from({}).key_split == DEFAULT_KEY_SPLIT


def test_read_once(env):
    env(VEXACT_KEY_SPLIT="512")
    assert refresh_settings().key_split == 512
    env(VEXACT_KEY_SPLIT="0")
    assert get_settings().key_split == 512  # the environment changed, the settings did not
    env(VEXACT_KEY_SPLIT="bad")
    assert get_settings().key_split == 512
    env(VEXACT_KEY_SPLIT="0")
    assert refresh_settings().key_split == 0 and get_settings().key_split == 0


def test_no_read_at_import():
    """Importing the package reads no setting (a refused environment fails at the first use only)."""
    code = "import vexact_vllm.kernels, vexact_vllm.kernels.settings as s; assert s._current is None"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "VEXACT_KEY_SPLIT": "bad"})


# Directories whose modules make up the package (and the scripts that ship with it).
SOURCES = ("kernels", "vexact_vllm", "model_patches", "benchmarks", "examples", "scripts")


def _environment_reads(tree: ast.AST):
    """(line, name) of every read of an environment variable named by a string constant: os.environ[...]
    (loaded), os.environ.get / setdefault / pop(...), os.getenv(...)."""

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and (
                (func.attr in ("get", "setdefault", "pop") and is_environ(func.value)) or func.attr == "getenv"
            ):
                key = node.args[0]
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            yield node.lineno, key.value


def test_only_settings_reads_vexact_variables():
    """No module but kernels/settings.py reads a VEXACT_* variable (writes, as benchmarks do before
    the settings are read, are allowed)."""
    offenders = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "kernels" / "settings.py":
                continue
            for line, name in _environment_reads(ast.parse(path.read_text(), str(path))):
                if name.startswith("VEXACT_"):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
    assert not offenders, offenders


def test_grep_finds_vexact_names_only_as_text():
    """`git grep VEXACT_` outside settings.py: the names appear in strings, docs and env dicts, never
    next to an environment read."""
    out = subprocess.run(["git", "grep", "-n", "VEXACT_", "--", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        pytest.skip("not a git checkout")
    read = re.compile(r"""(environ\.get\(|getenv\()\s*["']VEXACT_|environ\[\s*["']VEXACT_\w*["']\s*\](?!\s*=(?!=))""")
    lines = [ln for ln in out.stdout.splitlines() if not ln.startswith("kernels/settings.py:") and read.search(ln)]
    assert not lines, lines


def test_clear_leaves_the_read_to_the_next_use(env):
    env(VEXACT_KEY_SPLIT="256")
    assert refresh_settings().key_split == 256
    env(VEXACT_KEY_SPLIT="128")
    clear_settings()
    assert get_settings().key_split == 128 and get_settings() is get_settings()
