"""The `vexact-vllm` command: `check` (the bitwise judge), `fuzz` (random cases, repeatedly: the flake
hunter) and `bench` (throughput vs stock vLLM)."""

from __future__ import annotations

import argparse
import sys


def package_version() -> str:
    """The installed distribution's version, or the source tree's when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vexact-vllm")
    except PackageNotFoundError:
        from vexact_vllm import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    from . import bench as bench_cmd
    from . import check as check_cmd
    from . import fuzz as fuzz_cmd
    from .console import HelpFormatter

    parser = argparse.ArgumentParser(prog="vexact-vllm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="generate with vLLM and compare every log-prob with the trainer, bitwise",
                           description=check_cmd.HELP, formatter_class=HelpFormatter)  # fmt: skip
    check_cmd.add_arguments(check)
    bench = sub.add_parser("bench", help="output tokens/s of stock vLLM, stock batch-invariant and vexact",
                           formatter_class=HelpFormatter)  # fmt: skip
    bench_cmd.add_arguments(bench)
    fuzz = sub.add_parser("fuzz", help="random checkpoints, prompts and engine settings, every composition "
                          "checked bit for bit, repeatedly: flake rate and reproducers", formatter_class=HelpFormatter)  # fmt: skip
    fuzz_cmd.add_arguments(fuzz)
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:  # without importing torch and vLLM
        print(f"vexact-vllm {package_version()}")
        return 0
    from . import bench as bench_cmd
    from . import check as check_cmd
    from . import fuzz as fuzz_cmd

    args = build_parser().parse_args(argv)
    if args.command == "check":
        return check_cmd.run_check(args)
    if args.command == "fuzz":
        return fuzz_cmd.run_fuzz(args)
    return bench_cmd.run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
