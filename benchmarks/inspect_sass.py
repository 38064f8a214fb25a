"""Compile vexact's attention kernels for Hopper (sm_90a) on any machine, no GPU needed, and print what
the hardware would run: registers, spills, shared memory, and the instruction mix of each kernel.

    python benchmarks/inspect_sass.py [--kernels paged,paged-shared,prefix,varlen,dkdv,dq,groups,paged-thin,latent,...] [--head-dim 128] [--group 2]
        [--block-m 64] [--lines 20] [--out DIR]

Why: device time is scarce; a kernel that spills, loads K/V with scalar 16-bit loads instead of
128-bit cp.async (LDGSTS), or waits on every wgmma (HGMMA) shows it in its SASS, before any timing.
Run it with the GPU host's Triton (3.6: `pip install --target DIR triton==3.6.0`, then
PYTHONPATH=DIR) to see that host's code. The integer arguments are specialised as Triton's launcher
specialises them at run time (pointers and strides divisible by 16, as every tensor here is), and
the launch options (warps, stages, no FP contraction) are the wrappers' own. Each kernel's cubin and
SASS go to DIR (default: a temporary folder). registers / spill_stores of -1: the bundled ptxas gave
no figure for sm_90a (seen with Triton 3.9); the SASS counts still hold.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from sass_lines import line_profile, print_profile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vexact_vllm.kernels.attention import core_triton as core
from vexact_vllm.kernels.attention import paged_triton as paged_fwd
from vexact_vllm.kernels.attention import prefix_groups_triton as groups
from vexact_vllm.kernels.attention import prefix_triton as prefix
from vexact_vllm.kernels.attention import varlen_triton as varlen_fwd
from vexact_vllm.kernels.attention import varlen_triton_bwd as bwd
from vexact_vllm.kernels.attention.tiles import KEY_TILE
from vexact_vllm.kernels.settings import DEFAULT_KEY_SPLIT

FLOATS = {"qk_scale", "scale"}
INT_POINTERS = {"block_table_ptr", "seq_lens_ptr", "start_loc_ptr", "cu_ptr", "resume_ptr", "members_ptr", "tiles_ptr", "starts_ptr", "count_ptr", "table_ptr", "qsl_ptr",
                "scratch_ptr", "part_n_ptr"}  # fmt: skip
FP32_POINTERS = {"lse_ptr", "delta_ptr", "ws_acc_ptr", "ws_ml_ptr", "part_acc_ptr", "part_ml_ptr"}
# Instruction families worth counting (SASS opcode prefixes).
FAMILIES = ("HGMMA", "HMMA", "LDGSTS", "LDG", "STG", "LDS", "STS", "LDSM", "STL", "LDL", "MUFU", "SHFL",
            "WARPGROUP", "BAR", "DEPBAR")  # fmt: skip


def signature(kernel, constexprs: dict) -> tuple[dict, dict]:
    """(types, attrs) for ASTSource: bf16 tensors unless named otherwise, int32 scalars, divisibility
    16 on pointers and strides (what the launcher's specialisation gives these kernels)."""
    names = kernel.arg_names
    types, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = "*i32" if name in INT_POINTERS else "*fp32" if name in FP32_POINTERS else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            types[name] = "fp32"
        else:
            types[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return types, attrs


def specs(head_dim: int, group: int, block_m: int | None, warps: int | None = None) -> dict:
    """name -> (jit function, constexprs, launch options), as the wrappers launch them."""
    fwd_m, fwd_warps, fwd_stages = core.forward_config(head_dim, group)
    block_m = block_m or fwd_m
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_N=KEY_TILE, PRECISION="tf32", DOT_FP32=False)
    fwd_opts = dict(num_warps=warps or fwd_warps, num_stages=fwd_stages, enable_fp_fusion=False)
    (kv_m, kv_n, kv_w, kv_s), (q_m, q_n, q_w, q_s) = bwd.BWD_CONFIGS[head_dim]
    bwd_common = dict(GROUP=group, HEAD_DIM=head_dim, PRECISION="tf32", DOT_FP32=False)
    paged = dict(common, BLOCK_M=block_m, PAGE=16, SHARED=False)
    shared_opts = dict(fwd_opts, num_stages=paged_fwd.SHARED_STAGES.get(head_dim, fwd_stages))  # paged_attention(shared=)
    thin = dict(fwd_opts, num_stages=max((st for _, st in paged_fwd.THIN_STAGES.get(head_dim, ())), default=fwd_stages))
    # DeepSeek's latent (MLA): 512 latent + 64 rotary dims, one key head, 16 query heads a tile (Moonlight,
    # V2-Lite at TP=1), as paged_attention launches it; -split: a decode step's key chunks as programs
    lat_group, lat_m, lat_warps, lat_stages = core.latent_config(512, 64, 16)
    latent = dict(GROUP=lat_group, HEAD_DIM=512, HEAD_DIM_V=512, BLOCK_D=512, BLOCK_DV=512, BLOCK_M=block_m or lat_m,
                  BLOCK_N=KEY_TILE, PAGE=16, PRECISION="tf32", DOT_FP32=False, SHARED=False, HEAD_DIM_R=64,
                  BLOCK_R=64)  # fmt: skip
    latent_opts = dict(num_warps=warps or lat_warps, num_stages=lat_stages, enable_fp_fusion=False)
    return {
        "paged": (paged_fwd._paged_fwd_kernel, paged, fwd_opts),
        # rows past the default key split fold their chunks in the program (grpo's, long's)
        "paged-split": (paged_fwd._paged_fwd_kernel, dict(paged, SPLIT_TILES=DEFAULT_KEY_SPLIT // KEY_TILE), fwd_opts),
        "paged-thin": (paged_fwd._paged_fwd_kernel, paged, thin),  # thin steps' deepest
        "paged-shared-thin": (paged_fwd._paged_fwd_kernel, dict(paged, SHARED=True), thin),
        "prefix-thin": (prefix._shared_prefix_kernel, dict(common, BLOCK_M=block_m, PAGE=16), thin),
        "paged-shared": (paged_fwd._paged_fwd_kernel, dict(paged, SHARED=True), shared_opts),
        "prefix": (prefix._shared_prefix_kernel, dict(common, BLOCK_M=block_m, PAGE=16), shared_opts),
        "groups": (groups._groups_kernel, dict(PAGE=16, KEY_TILE=KEY_TILE, MAX_MEMBERS=block_m // group,
                   MEMBERS_P2=triton.next_power_of_2(block_m // group),
                   **dict(zip(("BLOCK_I", "BLOCK_J", "BLOCK_C", "BLOCK_S"), groups.BLOCKS))),
                   dict(num_warps=groups.NUM_WARPS)),  # fmt: skip
        "varlen": (varlen_fwd._varlen_fwd_kernel, dict(common, BLOCK_M=block_m, STORE_LSE=True), fwd_opts),
        "dkdv": (bwd._dkdv_kernel, dict(bwd_common, BLOCK_M=kv_m, BLOCK_N=kv_n), dict(num_warps=kv_w, num_stages=kv_s)),
        "dq": (bwd._dq_kernel, dict(bwd_common, BLOCK_M=q_m, BLOCK_N=q_n), dict(num_warps=q_w, num_stages=q_s)),
        "latent": (paged_fwd._paged_fwd_kernel, latent, latent_opts),
        "latent-split": (paged_fwd._paged_fwd_kernel, dict(latent, SPLIT_TILES=DEFAULT_KEY_SPLIT // KEY_TILE,
                         PARTIAL=True, CHUNKS=4), latent_opts),  # fmt: skip
    }


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def inspect(name: str, kernel, constexprs: dict, options: dict, out_dir: str) -> dict:
    types, attrs = signature(kernel, constexprs)
    compiled = triton.compile(ASTSource(fn=kernel, signature=types, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)  # fmt: skip
    cubin = os.path.join(out_dir, f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    ptx = os.path.join(out_dir, f"{name}.ptx")
    with open(ptx, "w") as f:
        f.write(compiled.asm["ptx"])
    verbose = subprocess.run([tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                             capture_output=True, text=True).stderr  # fmt: skip
    sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    with open(os.path.join(out_dir, f"{name}.sass"), "w") as f:
        f.write(sass)
    opcodes = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", sass, re.M)
    mix = collections.Counter()
    for op in opcodes:
        family = next((f for f in FAMILIES if op == f or op.startswith(f + ".")), None)
        if family:
            mix[op if family in ("LDG", "LDGSTS", "STS", "LDS") else family] += 1
    mma = sorted(set(re.findall(r"warpsPerCTA = \[(\d+), (\d+)\], instrShape = \[(\d+), (\d+), (\d+)\]",
                                compiled.asm["ttgir"])))  # fmt: skip
    layouts = " ".join(f"warps[{a},{b}]x{m}x{n}x{k}" for a, b, m, n, k in mma)
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, verbose)) else -1  # noqa: E731
    return {"kernel": name, "mma": layouts, "registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "shared_bytes": compiled.metadata.shared, "instructions": len(opcodes), "mix": dict(sorted(mix.items())),
            **{k: v for k, v in options.items() if k != "enable_fp_fusion"}, **{k: v for k, v in constexprs.items() if k.startswith("BLOCK")}}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="paged,paged-shared,prefix,varlen,dkdv,dq")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=2, help="query heads per kv head (Qwen3-1.7B: 2, 8B: 4)")
    parser.add_argument("--block-m", type=int, help="forward rows per tile (default: the wrappers' config)")
    parser.add_argument("--warps", type=int, help="forward warps (default: the wrappers' config); with --block-m "
                        "128 --warps 8 the mma layouts show whether rows keep their arithmetic")  # fmt: skip
    parser.add_argument("--stages", type=int, help="num_stages of every kernel (default: each launch's own)")
    parser.add_argument("--maxnreg", type=int, help="cap each kernel's registers a thread (ptxas .maxnreg; "
                        "spills show in spill_stores): how many programs could share an SM")  # fmt: skip
    parser.add_argument("--out", help="folder for the cubin, PTX and SASS of each kernel")
    parser.add_argument("--lines", type=int, default=0, help="print each kernel's N busiest source lines (sass_lines.py)")
    args = parser.parse_args()
    out_dir = args.out or tempfile.mkdtemp(prefix="vexact-sass-")
    os.makedirs(out_dir, exist_ok=True)
    table = specs(args.head_dim, args.group, args.block_m, args.warps)
    print(f"Triton {triton.__version__}, sm_90a, head_dim {args.head_dim}, group {args.group}; files in {out_dir}")
    for name in args.kernels.split(","):
        if name not in table:
            sys.exit(f"unknown kernel {name!r}; choose from {', '.join(table)}")
        kernel, constexprs, options = table[name]
        options = dict(options, **{k: v for k, v in (("num_stages", args.stages), ("maxnreg", args.maxnreg)) if v})
        row = inspect(name, kernel, constexprs, options, out_dir)
        mix = row.pop("mix")
        print(" ".join(f"{k}={v}" for k, v in row.items()))
        print("   ", " ".join(f"{k}:{v}" for k, v in mix.items()))
        if args.lines:
            print_profile(line_profile(os.path.join(out_dir, f"{name}.ptx")), args.lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
