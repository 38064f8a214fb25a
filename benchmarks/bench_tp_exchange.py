"""The tensor-parallel exchange on two GPUs: what one `TensorParallel.gather` costs through each path,
vLLM's all-gather (NCCL, then the copy that lays the blocks out along the last dim) against the sum over
-0.0 on vLLM's custom all-reduce (fill, copy, one kernel), for the messages a Qwen3-8B-shaped layer
exchanges (heads 4096, hidden 4096, MLP 12288 in bf16; the lm_head's fp32 logits), at decode and
prefill row counts. Both paths are timed inside a CUDA graph of 20 gathers replayed (vLLM replays
decode steps), median of the replays, microseconds per gather; "stock" is vLLM's own all-reduce of the
same [rows, n] (what stock's row-parallel layers exchange), for scale.

    python benchmarks/bench_tp_exchange.py [--rows 1,16,64,256,1024] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import socket

import torch

WORLD = 2
MESSAGES = [("heads/hidden", 4096, torch.bfloat16), ("mlp", 12288, torch.bfloat16),
            ("logits (fp32)", 151936, torch.float32)]  # fmt: skip


def _timed(fn, repeats: int = 20, replays: int = 15) -> float:
    """Microseconds per call of fn, replayed in a CUDA graph of `repeats` calls."""
    from vllm.distributed import graph_capture

    with graph_capture(device=torch.device("cuda", torch.cuda.current_device())) as context:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=context.stream):
            for _ in range(repeats):
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.distributed.barrier()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeats)
    return sorted(times)[len(times) // 2]


def _worker(rank: int, port: int, rows_list: list[int], out_path: str | None) -> None:
    from vllm.distributed import get_tp_group

    from vexact_vllm.model_patches.tensor_parallel import TensorParallel
    from vexact_vllm.vllm_wrapper import join_tensor_parallel_group

    summed = join_tensor_parallel_group(rank, WORLD, port)
    gathered = TensorParallel(summed.rank, summed.size, summed.all_gather)
    group = get_tp_group()
    table = []
    for label, n, dtype in MESSAGES:
        for rows in rows_list:
            if rows * n * torch.tensor([], dtype=dtype).element_size() > 2**30:
                continue  # a step's logits come in chunks of at most 1,024 rows
            block = torch.randn(rows, n // WORLD, device="cuda").to(dtype)
            full = torch.randn(rows, n, device="cuda").to(dtype)
            takes = summed.reduces is not None and summed.reduces(full)
            row = {"message": label, "rows": rows, "n": n, "MiB": rows * n * full.element_size() / 2**20,
                   "all_gather_us": _timed(lambda b=block, n=n: gathered.gather(b, n)),
                   "sum_us": _timed(lambda b=block, n=n: summed.gather(b, n)) if takes else None,
                   "stock_all_reduce_us": _timed(lambda f=full: group.all_reduce(f))}  # fmt: skip
            table.append(row)
    if rank == 0:
        print(f"{'message':<14} {'rows':>6} {'MiB':>8} {'all-gather us':>14} {'sum over -0.0 us':>17} "
              f"{'stock all-reduce us':>20}")  # fmt: skip
        for r in table:
            sum_us = "-" if r["sum_us"] is None else f"{r['sum_us']:.1f}"
            print(f"{r['message']:<14} {r['rows']:>6} {r['MiB']:>8.2f} {r['all_gather_us']:>14.1f} {sum_us:>17} "
                  f"{r['stock_all_reduce_us']:>20.1f}")  # fmt: skip
        if out_path:
            with open(out_path, "w") as f:
                json.dump(table, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,256,1024,8192", help="row counts (tokens in a step)")
    parser.add_argument("--json", help="write the table here too")
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD:
        raise SystemExit(f"error: this benchmark needs {WORLD} CUDA GPUs (found {torch.cuda.device_count()})")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = [int(r) for r in args.rows.split(",")]
    mp.start_processes(_worker, args=(port, rows, args.json), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
