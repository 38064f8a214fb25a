"""`vexact-vllm --version` and `--help`: every option of every command shows its default."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from vexact_vllm import __version__
from vexact_vllm.cli import build_parser, main
from vexact_vllm.cli.console import HelpFormatter


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"vexact-vllm {__version__}"
    out = subprocess.run([sys.executable, "-m", "vexact_vllm.cli", "--version"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert out.strip() == f"vexact-vllm {__version__}"


@pytest.mark.parametrize("command", ["check", "bench", "fuzz"])
def test_every_option_shows_its_default(command):
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub = commands.choices[command]
    formatter = sub._get_formatter()
    options = [a for a in sub._actions if a.option_strings and a.help is not argparse.SUPPRESS and a.dest != "help"]
    assert len(options) > 10
    for action in options:
        text = formatter._get_help_string(action)
        assert "default" in text, f"{command} {action.option_strings[0]}: {text!r} does not show its default"
    assert "(default: 24)" in " ".join(sub.format_help().split()) if command == "check" else True


def test_help_formatter_defaults():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--n", type=int, default=3, help="count")
    parser.add_argument("--sizes", default=[1, 3, 0], help="sizes")
    parser.add_argument("--flag", action="store_true", help="a switch")
    parser.add_argument("--said", default=5, help="five (default: five)")
    text = " ".join(parser.format_help().split())
    assert "count (default: 3)" in text and "sizes (default: 1,3,0)" in text
    assert "a switch (default: off)" in text and "five (default: five)" in text and "(default: 5)" not in text
