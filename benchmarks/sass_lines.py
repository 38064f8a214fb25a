"""Where a compiled Triton kernel's SASS instructions come from: a static profile by source line.

    from sass_lines import line_profile
    rows = line_profile(ptx_path)  # [(count, "file.py:line", {opcode: count, ...}), ...], most first

ptxas compiles the PTX for sm_90a with line info and nvdisasm (both bundled with Triton) annotates
each instruction with the source line it came from (the innermost @triton.jit routine's line, so a
routine called from several places sums its calls). No GPU is needed. Static counts say where the
code is, not where the time goes (loops, stalls and occupancy are not in them); on a kernel without
loops whose programs run one at a time, like a decode step's, they are a first map of its cost.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton

_FILE = re.compile(r'//## File "([^"]+)", line (\d+)')
_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*)")


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _ptxas() -> str:
    """The bundled ptxas; the newer one where Triton bundles two (Triton 3.9's PTX is too new for `ptxas`)."""
    newer = _tool("ptxas-blackwell")
    return newer if os.path.exists(newer) else _tool("ptxas")


def annotated_sass(ptx_path: str, arch: str = "sm_90a") -> str:
    """nvdisasm's listing of the PTX compiled with line info."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        subprocess.run([_ptxas(), f"-arch={arch}", "-lineinfo", ptx_path, "-o", cubin], check=True,
                       capture_output=True)  # fmt: skip
        return subprocess.run([_tool("nvdisasm"), "-g", cubin], check=True, capture_output=True, text=True).stdout


def count_by_line(sass: str) -> list[tuple[int, str, dict]]:
    """(instructions, "file:line", {opcode: count}) of an annotated listing, most instructions first."""
    where, total, ops = None, collections.Counter(), collections.defaultdict(collections.Counter)
    for line in sass.splitlines():
        if m := _FILE.search(line):
            where = f"{os.path.basename(m.group(1))}:{m.group(2)}"
        elif (m := _OP.match(line)) and where:
            total[where] += 1
            ops[where][m.group(1)] += 1
    return [(n, at, dict(ops[at].most_common())) for at, n in total.most_common()]


def line_profile(ptx_path: str, arch: str = "sm_90a") -> list[tuple[int, str, dict]]:
    return count_by_line(annotated_sass(ptx_path, arch))


def print_profile(rows: list[tuple[int, str, dict]], top: int) -> None:
    print(f"  {sum(n for n, _, _ in rows)} instructions; the {min(top, len(rows))} source lines with the most:")
    for n, at, ops in rows[:top]:
        print(f"  {n:6d}  {at:36s} {' '.join(f'{k}:{v}' for k, v in list(ops.items())[:6])}")
