"""The `vexact-vllm` command: `check` (the bitwise judge)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vexact-vllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="generate with vLLM and compare every log-prob with the trainer, bitwise")
    from .check import add_arguments, run_check

    add_arguments(check)
    args = parser.parse_args(argv)
    if args.command == "check":
        return run_check(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
