"""Compile design C's Gated DeltaNet kernels (kernels/gated_delta/incremental_*triton*.py) for Hopper
(sm_90a) on any machine, no GPU needed, and check what the bitwise invariant needs of the compiled code.

    python benchmarks/inspect_gated_delta.py [--dtype bf16|fp32] [--rows 16] [--block-v 64] [--warps 4] [--out DIR]
        [--step-warps 4] [--step-maxnreg 128] [--lines 20]

The decode kernels reproduce a chunk kernel's row only if every shared routine
(`incremental_tiles_triton.py`) compiles to the same arithmetic in both. Triton picks each tensor's layout
per kernel, from the code around it, so the check is on the compiled TTGIR:
1. every dot of a shared routine in the decode kernels has a twin in a chunk kernel: the same routine and
   call chain, K, operand and result types, precision, and kind: both tensor-core products (an element of
   a bf16 MMA depends only on its row, column and accumulator, so the chunk kernels' 64-row wgmma and the
   decode kernels' 16-row mma.sync agree: tests/kernels/gated_delta/test_dot_rows_cuda.py) or both FMA dots (which
   add in K order, whatever their blocked layout and shape): M and N may differ;
2. every tt.reduce of the forward kernels is an exact pick (`pick`, `pick_along`, `pick_one`, `pick_entries`,
   `first_column`: one nonzero term), never a sum that rounds (its tree would follow the layout);
3. each kernel's shared memory fits an H100/H200 SM (227 KiB), with its registers and spills where the
   bundled ptxas reports them.
--lines N prints each kernel's SASS instructions by source line, the N lines with the most
(`sass_lines.py`: a static map of where the code is, without a GPU).
Exit status 1 when a check fails. Run it with the GPU host's Triton to check that version's choices.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile

import triton
from sass_lines import line_profile, print_profile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vexact_vllm.kernels.gated_delta import incremental_chunk_triton as chunk
from vexact_vllm.kernels.gated_delta import incremental_decode_triton as decode
from vexact_vllm.kernels.gated_delta import incremental_tiles_triton as tiles
from vexact_vllm.kernels.gated_delta import incremental_triton_bwd as bwd

SHARED_LIMIT = 227 * 1024
INTS = {"HK", "HV", "RATIO", "S_STATE", "S_H0", "S_HT", "S_HT_DT", "S_STATE_DT", "SK", "SX", "SG", "SB", "ST",
        "SVN"}  # the slot strides: ints  # fmt: skip
# Ints the launcher's specialisation finds divisible by 16 at the published shapes (16 k heads, 32 or 48
# v heads, the slots' strides): all but RATIO (2 or 3).
DIVISIBLE_INTS = INTS - {"RATIO"}
FLOATS = {"scale", "eps"}
F32_POINTERS = {"A_LOG", "DT_BIAS", "GR", "BETA", "GC", "TS", "CG", "CB", "CT", "H0", "HT", "STATE", "DHT", "DH", "DVN", "T_ROW",
                "DH0", "DQ", "DK_", "DV_", "DG", "DBETA"}  # fmt: skip
I64_POINTERS = {"EOS", "BOS", "CHUNK_SEQ", "CHUNK_ROW", "CHUNK_SRC", "CACHE_SLOT", "CHUNK_START", "READ", "WRITE", "START", "COUNT",
                "HELD", "SLOT"}  # fmt: skip
EXACT_PICKS = {"pick", "pick_along", "pick_one", "pick_entries", "first_column"}
CHUNK_KERNELS = ("normalize", "prepare", "state", "output")


# Kernels whose inputs of these names are fp32: the decode kernels read the row's g and beta as
# `prepared_rows` left them.
F32_INPUTS = {"decode_weights": {"A", "B"}, "decode": {"A"}}


def signature(kernel, constexprs: dict, dtype: str, f32: set = frozenset()) -> tuple[dict, dict]:
    """(types, attrs) for ASTSource: pointers in the input dtype unless fp32 / int64 scratch (or named in
    `f32`), int32 scalars, divisibility 16 on pointers and strides (as the launchers' tensors specialise)."""
    types, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            types[name] = "constexpr"
        elif (name.isupper() or name.endswith("_")) and name not in INTS:
            types[name] = "*fp32" if name in F32_POINTERS | f32 else "*i64" if name in I64_POINTERS else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            types[name] = "fp32"
        else:
            types[name] = "i32"
            if name.startswith("stride") or name in DIVISIBLE_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return types, attrs


def specs(dtype: str, rows: int, block_v: int) -> dict:
    """name -> (kernel, constexprs, launch options) at Qwen3-Next / Qwen3.5's d_k = d_v = 128, chunks of 64."""
    dots = dict(PRECISION="ieee" if dtype == "fp32" else "tf32", DOT_FP32=False)
    base = dict(DK=128, DV=128, BLOCK_K=128, ROWS=rows, CHUNK=64)
    back = dict(DK=128, DV=128, BLOCK_K=128, BLOCK_V=block_v, CHUNK=64, PRECISION="ieee" if dtype == "fp32" else "bf16")
    return {
        "normalize": (chunk.normalize_kernel, dict(base, BLOCK_DV=128, SOFTPLUS_MAX=20.0, PACKED=False),
                      tiles.launch_options()),
        "prepare": (chunk.prepare_kernel, dict(base, BLOCK_V=block_v, **dots), tiles.launch_options("prepare")),
        "state": (chunk.state_kernel, dict(base, BLOCK_V=block_v, **dots), tiles.launch_options("state")),
        "output": (chunk.output_kernel, dict(base, BLOCK_V=block_v, **dots), tiles.launch_options("output")),
        "decode_weights": (decode._decode_weights_kernel, dict(DK=128, BLOCK_K=128, ROWS=rows, CHUNK=64, **dots),
                           tiles.launch_options(step=True)),
        "decode": (decode._decode_kernel, dict(base, BLOCK_V=block_v, **dots), tiles.launch_options(step=True)),
        "bwd_state": (bwd._bwd_state_kernel, back, bwd.LAUNCH),
        "bwd_chunk": (bwd._bwd_chunk_kernel, back, bwd.LAUNCH),
    }


def _functions(path: str) -> dict[int, str]:
    """line -> name of the function of a source file that holds it."""
    names = {}
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.FunctionDef):
            for line in range(node.lineno, node.end_lineno + 1):
                names[line] = node.name
    return names


class Ttgir:
    """A kernel's TTGIR: its layouts, and each op's call chain (file:line, innermost first)."""

    def __init__(self, text: str):
        self.text = text
        self.layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", text, re.M))
        self.files = {k: (f, int(n)) for k, f, n in re.findall(r'^(#loc\d+) = loc\("([^"]+)":(\d+):\d+\)', text, re.M)}
        self.calls = {k: (a, b) for k, a, b in re.findall(r"^(#loc\d+) = loc\(callsite\((#loc\d+) at (#loc\d+)\)\)", text, re.M)}
        self.names = dict(re.findall(r'^(#loc\d+) = loc\("[^"]*"\((#loc\d+)\)\)', text, re.M))

    def chain(self, loc: str) -> list[tuple[str, int]]:
        while loc in self.names:
            loc = self.names[loc]
        if loc in self.calls:
            inner, outer = self.calls[loc]
            return self.chain(inner) + self.chain(outer)
        return [self.files[loc]] if loc in self.files else []

    def layout(self, name: str) -> str:
        text = self.layouts.get(name, name)
        if "nvidia_mma" in text:
            version = re.search(r"versionMajor = (\d+)", text).group(1)
            shape = re.search(r"instrShape = \[([\d, ]+)\]", text).group(1)
            return f"mma v{version} {shape.replace(' ', '')}"
        return "fma" if "blocked" in text else text

    def dots(self) -> list[tuple[tuple, str]]:
        """(call chain in the shared routines, 'A x B -> C layout precision') of every dot."""
        found = []
        for line in self.text.split("\n"):
            if " = tt.dot " not in line and " = ttng.warp_group_dot " not in line:
                continue
            precision = re.search(r"inputPrecision = (\w+)", line)
            precision = {"0": "tf32", "1": "tf32x3", "2": "ieee"}.get(precision.group(1), precision.group(1)) if precision else "ieee"
            (ka, a), (kb, b), (_, out) = re.findall(r"(tensor|!ttg\.memdesc)<(\d+x\d+x\w+)", line.split(" : ", 1)[1])[:3]
            a, b = (f"{x}{' (smem)' if kind.startswith('!') else ''}" for kind, x in ((ka, a), (kb, b)))
            layout = re.search(r"-> tensor<[^,]+, (#\w+)>", line).group(1)
            loc = re.search(r"loc\((#loc\d+)\)\s*$", line).group(1)
            frames = tuple(f"{os.path.basename(f)}:{n}" for f, n in self.chain(loc) if f.endswith("tiles_triton.py"))
            found.append((frames, f"{a} x {b} -> {out} {self.layout(layout)} {precision}"))
        return found

    def reduces(self) -> list[tuple[str, ...]]:
        """The call chain of every tt.reduce."""
        out = []
        for start in re.finditer(r'"tt\.reduce"', self.text):
            tail = re.search(r"\}\) : \([^)]*\) -> [^\n]*? loc\((#loc\d+)\)", self.text[start.end() :])
            out.append(tuple(f"{os.path.basename(f)}:{n}" for f, n in self.chain(tail.group(1))))
        return out


def dot_key(sig: str) -> tuple:
    """What a dot's twin shares (module docstring, 1.): of 'MxKxT x KxNxT -> MxNxT layout precision', all
    but M, N and, for a tensor-core product, its instruction."""
    m = re.match(r"\d+x(\d+)x(\w+)(?: \(smem\))? x (\d+)x(\d+)x(\w+)(?: \(smem\))? -> \d+x(\d+)x(\w+) (.+) (\w+)$", sig)
    k, a_type, _, _, b_type, _, out_type, layout, precision = m.groups()
    return k, a_type, b_type, out_type, "fma" if layout == "fma" else "mma", precision


def compile_kernel(name, kernel, constexprs, options, dtype, out_dir) -> tuple[Ttgir, dict]:
    types, attrs = signature(kernel, constexprs, dtype, F32_INPUTS.get(name, set()))
    compiled = triton.compile(ASTSource(fn=kernel, signature=types, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)  # fmt: skip
    ptx = os.path.join(out_dir, f"{name}.ptx")
    with open(ptx, "w") as f:
        f.write(compiled.asm["ptx"])
    with open(os.path.join(out_dir, f"{name}.ttgir"), "w") as f:
        f.write(compiled.asm["ttgir"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = os.path.join(tools, "ptxas-blackwell")  # the newer one: Triton 3.9's PTX is too new for `ptxas`
    ptxas = ptxas if os.path.exists(ptxas) else os.path.join(tools, "ptxas")
    verbose = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True).stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, verbose)) else -1  # noqa: E731
    stats = {"shared": compiled.metadata.shared, "registers": number(r"Used (\d+) registers"),
             "spill_stores": number(r"(\d+) bytes spill stores")}  # fmt: skip
    return Ttgir(compiled.asm["ttgir"]), stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--rows", type=int, default=tiles.ROWS, help="row tile (incremental_tiles_triton.ROWS)")
    parser.add_argument("--block-v", type=int, default=tiles.BLOCK_V, help="v tile (incremental_tiles_triton.BLOCK_V)")
    parser.add_argument("--warps", type=int, default=None,
                        help="every forward kernel's warps (default: incremental_tiles_triton.WARPS, KERNEL_WARPS)")
    parser.add_argument("--step-warps", type=int, default=tiles.STEP_WARPS,
                        help="the decode kernels' warps (incremental_tiles_triton.STEP_WARPS; None: WARPS)")
    parser.add_argument("--step-maxnreg", type=int, default=tiles.STEP_MAXNREG,
                        help="the decode kernels' register cap (incremental_tiles_triton.STEP_MAXNREG)")
    parser.add_argument("--kernels", default=None, help="comma-separated subset (default: all)")
    parser.add_argument("--out", help="folder for each kernel's PTX and TTGIR")
    parser.add_argument("--lines", type=int, default=0, help="print each kernel's N busiest source lines (SASS)")
    args = parser.parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="vexact-gdn-")
    os.makedirs(out_dir, exist_ok=True)
    if args.warps is not None:
        tiles.WARPS, tiles.KERNEL_WARPS = args.warps, {}
    tiles.STEP_WARPS, tiles.STEP_MAXNREG = args.step_warps, args.step_maxnreg
    table = specs(args.dtype, args.rows, args.block_v)
    names = args.kernels.split(",") if args.kernels else list(table)
    functions = _functions(tiles.__file__)
    print(f"Triton {triton.__version__}, sm_90a, {args.dtype}, ROWS {args.rows}, BLOCK_V {args.block_v}, "
          f"{tiles.WARPS} warps, {tiles.KERNEL_WARPS or 'no kernel its own'} (decode kernels "
          f"{args.step_warps or tiles.WARPS}, register cap {args.step_maxnreg}); "
          f"files in {out_dir}")  # fmt: skip
    compiled, failures = {}, []
    for name in names:
        kernel, constexprs, options = table[name]
        try:
            compiled[name], stats = compile_kernel(name, kernel, constexprs, options, args.dtype, out_dir)
        except Exception as e:  # a kernel that does not compile is a finding, not a crash
            failures.append(f"{name}: does not compile: {str(e)[-1200:]}")
            continue
        print(f"{name:10} shared {stats['shared']:>7} B  registers {stats['registers']:>4}  spill stores {stats['spill_stores']}")
        if args.lines:
            print_profile(line_profile(os.path.join(out_dir, f"{name}.ptx")), args.lines)
        if stats["shared"] > SHARED_LIMIT:
            failures.append(f"{name}: {stats['shared']} B of shared memory > {SHARED_LIMIT}")

    def routine(frame: str) -> str:
        return functions.get(int(frame.split(":")[1]), "?")

    chunk_dots = {d for n in CHUNK_KERNELS if n in compiled for d in compiled[n].dots()}
    chunk_keys = {(f, dot_key(s)) for f, s in chunk_dots}
    for name in [n for n in ("decode_weights", "decode") if n in compiled]:  # 1. every shared dot: a twin
        for frames, sig in sorted(set(compiled[name].dots())):
            where = " <- ".join(routine(f) for f in frames)
            twin = (frames, dot_key(sig)) in chunk_keys
            same_routine = [s for f, s in chunk_dots if f == frames]
            print(f"  {name} dot {where:40} {sig}  {'== chunk' if twin else 'NO TWIN'}")
            if frames and not twin and same_routine:
                failures.append(f"{name}'s {where} dot {sig} differs from the chunk kernels' {same_routine}")
            elif frames and not twin:
                failures.append(f"{name}'s {where} dot {sig} has no chunk-kernel twin")
    for name in [n for n in compiled if not n.startswith("bwd")]:  # 2. reductions are exact picks
        for chain in compiled[name].reduces():
            routines = [routine(f) for f in chain if "tiles_triton" in f]
            if not routines or routines[0] not in EXACT_PICKS:
                failures.append(f"{name}: a tt.reduce that may round, at {' <- '.join(chain)}")
    for line in failures:
        print("FAIL", line)
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
