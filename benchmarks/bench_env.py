"""What the benchmark scripts share: the environment a run records (date, device, versions, commit,
command), report sections that fail alone, and the ops a call spends its time in (`top_ops`). The scripts import it as a sibling module: running
`python benchmarks/X.py` puts this folder on sys.path, and tests/benchmarks/conftest.py's
`load_script` does too."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import traceback
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version

import torch


def version(*names: str) -> str | None:
    """The version of the first of `names` (distribution names) that is installed, else None."""
    for name in names:
        try:
            return distribution_version(name)
        except PackageNotFoundError:
            continue
    return None


def environment(device: str, packages: dict[str, tuple[str, ...]]) -> dict:
    """What a run records: UTC date, the device, torch's version and each of `packages` (key -> the
    distribution names that provide it, first installed wins), the commit and the command."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()  # fmt: skip
    except Exception:
        commit = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        **{key: version(*names) for key, names in packages.items()},
        "commit": commit,
        "command": " ".join(["python", *sys.argv]),
    }


def sections(rows: list[dict]) -> Callable:
    """A decorator for a report's sections: a section that raises prints its traceback and records an
    ERROR row in `rows`, and the next sections still run."""

    def section(fn):
        def run(*args):
            try:
                fn(*args)
            except Exception:  # one section failing must not hide the others
                traceback.print_exc()
                rows.append({"section": fn.__name__, "case": "ERROR", "error": traceback.format_exc(limit=3)})

        return run

    return section


def top_ops(call: Callable[[], object], cuda: bool, top: int, calls: int = 1) -> list[dict]:
    """The `top` ops of `calls` runs of `call` under torch.profiler by self time on the device (on the
    CPU without CUDA), largest first: name, ms a run, calls a run and share of the summed self time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key) > 0]
    total = sum(getattr(e, key) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    return [{"op": e.key, "ms": getattr(e, key) / 1e3 / calls, "calls": e.count // calls, "share": getattr(e, key) / total}
            for e in events[:top]]  # fmt: skip


def print_ops(title: str, ops: list[dict]) -> None:
    """`top_ops`' rows as a table under `title`."""
    print(f"\n{title}")
    print(f"{'ms':>9s} {'share':>6s} {'calls':>6s}  op")
    for op in ops:
        print(f"{op['ms']:9.3f} {op['share']:6.1%} {op['calls']:6d}  {op['op'][:100]}")
