"""benchmarks/sass_lines.py: the by-line count of an annotated SASS listing, and, where Triton's bundled
ptxas and nvdisasm run here, a real kernel compiled for sm_90a whose instructions land on its own lines."""

from __future__ import annotations

import os
import tempfile

import pytest

LISTING = """
        .text._k:
	//## File "/x/kernels/a_triton.py", line 12
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!PT IMAD R2, R3, R4, R5 ;
	//## File "/x/kernels/b_triton.py", line 7
        /*0020*/                   FFMA R6, R7, R8, R6 ;
        /*0030*/                   FFMA R6, R9, R8, R6 ;
        /*0040*/              @P0  BRA 0x90 ;
	//## File "/x/kernels/a_triton.py", line 12
        /*0050*/                   IMAD R2, R3, R4, R5 ;
        /*0060*/                   EXIT ;
"""


def test_counts_each_instruction_at_its_line(load_script):
    sass_lines = load_script("sass_lines")
    rows = sass_lines.count_by_line(LISTING)
    assert rows == [
        (4, "a_triton.py:12", {"IMAD": 2, "LDC": 1, "EXIT": 1}),
        (3, "b_triton.py:7", {"FFMA": 2, "BRA": 1}),
    ]


def test_a_compiled_kernel_profiles_by_its_source_lines(load_script, capsys):
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sass_lines = load_script("sass_lines")
    if not os.path.exists(sass_lines._tool("nvdisasm")):
        pytest.skip("this Triton bundles no nvdisasm")

    @triton.jit
    def scale(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        tl.store(y_ptr + offs, x * 3.0 + 1.0)

    src = ASTSource(fn=scale, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 256})  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "scale.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        rows = sass_lines.line_profile(ptx)
    lines = {at: ops for _, at, ops in rows}
    here = os.path.basename(__file__)
    assert any(at.startswith(here) and "FFMA" in ops for at, ops in lines.items()), rows
    assert any(at.startswith(here) and any(op.startswith("LDG") for op in ops) for at, ops in lines.items()), rows
    sass_lines.print_profile(rows, 2)
    assert "instructions; the 2 source lines with the most" in capsys.readouterr().out
