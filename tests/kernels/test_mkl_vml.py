"""The MKL VML warm-up (kernels/mkl_vml.py): it covers every function ATen sends to VML, and it has
run, in a fresh process, by the time the package is imported."""

import re
import subprocess
import sys
from pathlib import Path

import torch

from vexact_vllm.kernels.mkl_vml import VML_OPS


def _aten_vml_ops() -> set[str]:
    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    assert header.exists(), f"{header} is missing: cannot tell which functions ATen sends to MKL VML"
    lines = [line.strip() for line in header.read_text().splitlines()]
    return {m.group(1) for line in lines if (m := re.match(r"IMPLEMENT_VML_MKL\((\w+),", line))}


def test_every_vml_function_of_aten_is_warmed():
    aten = _aten_vml_ops()
    assert "exp" in aten and "log" in aten  # the header parsed
    assert aten <= set(VML_OPS), f"add {sorted(aten - set(VML_OPS))} to VML_OPS"
    assert all(callable(getattr(torch, name, None)) for name in VML_OPS)


def test_importing_the_kernels_warms_every_function_in_both_precisions():
    code = (
        "import torch, vexact_vllm.kernels\n"
        "from vexact_vllm.kernels.mkl_vml import warmed\n"
        "print(torch.backends.mkl.is_available(), len(set(warmed)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    mkl, n = out[0] == "True", int(out[1])
    assert n == (2 * len(VML_OPS) if mkl else 0)
