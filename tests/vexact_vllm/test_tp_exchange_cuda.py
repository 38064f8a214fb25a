"""The tensor-parallel exchange on two GPUs, through vLLM's own groups (NCCL, its custom all-reduce):
every rank's `TensorParallel.gather` (the one `tensor_parallel_group()` builds in a vLLM worker) must
return the whole matrix, bit for bit, whichever path carries the message: the sum over -0.0 on vLLM's
custom all-reduce (eager, and replayed inside a CUDA graph captured as vLLM's runner captures: over
the rank's kept -0.0 buffer, over one first met inside the capture, and with a GEMM writing its block
straight into the buffer) or the all-gather past its size. The blocks hold what activations can hold: subnormals (SiLU far below zero),
+0.0 and -0.0, inf, NaN, the largest finite values; uneven blocks too. Each all-reduce implementation
(the custom one, pynccl, torch.distributed's NCCL) is also asked directly whether it keeps a block over
-0.0 exact, so a failure names the implementation that flushes or rounds."""

from __future__ import annotations

import socket

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

WORLD = 2


def special_matrix(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random normals with every special value sprinkled in (the same on every rank for a seed)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g).to(dtype)
    info = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.max, -info.max,
                             info.tiny, -info.tiny, info.tiny / 2, -info.tiny / 4, info.smallest_normal / 8,
                             info.tiny * info.eps, -info.tiny * info.eps]).to(dtype)  # fmt: skip
    where = torch.randperm(rows * n, generator=g)[: max(1, rows * n // 5)]  # distinct: the same on every rank
    pick = torch.randint(0, specials.numel(), where.shape, generator=g)
    x.view(-1)[where] = specials[pick]
    return x


def same_bits(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if equal bit for bit (NaN anywhere NaN is wanted: its payload may be canonicalised), else
    where they differ."""
    got, want = got.cpu(), want.cpu()
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        i = (got.isnan() != nan).nonzero()[0].tolist()
        return (f"NaN positions differ ({int(got.isnan().sum())} NaN, want {int(nan.sum())}), first at {i}: "
                f"got {got[tuple(i)].item()!r}, want {want[tuple(i)].item()!r}")
    ints = {2: torch.int16, 4: torch.int32}[want.element_size()]
    diff = (got.view(ints) != want.view(ints)) & ~nan
    if diff.any():
        i = diff.nonzero()[0].tolist()
        return f"{int(diff.sum())} elements differ, first at {i}: got {got[tuple(i)].item()!r}, want {want[tuple(i)].item()!r}"
    return None


def _worker(rank: int, port: int, cases: list, errors) -> None:
    from vllm.distributed import get_tp_group, graph_capture

    from vexact_vllm.kernels.gemm.linear import linear
    from vexact_vllm.model_patches.tensor_parallel import shard_bounds
    from vexact_vllm.vllm_wrapper import join_tensor_parallel_group, tensor_parallel_group

    tp = join_tensor_parallel_group(rank, WORLD, port)
    comm = get_tp_group().device_communicator
    found = []

    def torch_nccl(b):
        out = b.clone()
        torch.distributed.all_reduce(out, group=get_tp_group().device_group)
        return out

    if tp.all_reduce is None:
        found.append("vLLM's custom all-reduce is disabled on this host: the sum path is not exercised")
    for rows, n, dtype, seed in cases:
        want = special_matrix(rows, n, dtype, seed).cuda()
        block = tp.take(want, dim=1).contiguous()
        name = f"[{rows}, {n}] {dtype}"
        problem = same_bits(tp.gather(block, n), want)
        if problem:
            found.append(f"gather {name} (eager): {problem}")
        buf = torch.full_like(want, -0.0)
        start, stop = tp.bounds(n)
        buf[:, start:stop] = block
        implementations = {"torch.distributed NCCL": torch_nccl}
        if comm.pynccl_comm is not None and not comm.pynccl_comm.disabled:
            implementations["pynccl"] = comm.pynccl_comm.all_reduce
        if comm.ca_comm is not None and comm.ca_comm.should_custom_ar(buf):
            implementations["vLLM custom all-reduce"] = comm.ca_comm.custom_all_reduce
        for impl, reduce in implementations.items():
            problem = same_bits(reduce(buf), want)
            if problem:
                found.append(f"{impl} over -0.0, {name}: {problem}")
        if tp.block_buffer(rows, n, want) is not None:  # the sum path, replayed in CUDA graphs
            # `tp` kept its -0.0 buffer from the eager gather; a fresh group meets the width inside the
            # capture (a per-call buffer); and a GEMM writes its block straight into the kept buffer
            fresh_tp = tensor_parallel_group()
            source = torch.empty_like(block)
            g = torch.Generator(device="cuda").manual_seed(seed)  # the same on every rank
            weights = [torch.randn(b - a, 64, device="cuda", generator=g).to(dtype)
                       for a, b in (shard_bounds(n, WORLD, r) for r in range(WORLD))]  # fmt: skip
            x = torch.zeros(rows, 64, device="cuda", dtype=dtype)
            if dtype != torch.float16:
                linear(x, weights[rank], config_n=n)  # compiled before the capture
            with graph_capture(device=torch.device("cuda", rank)) as context:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=context.stream):
                    outs = {"kept buffer": tp.gather(source, n), "buffer met in capture": fresh_tp.gather(source, n)}
                    if dtype != torch.float16:  # the GEMM's dtypes: bf16, fp32
                        outs["GEMM into the buffer"] = tp.gather_output(
                            lambda o, x=x, w=weights[rank], n=n: linear(x, w, out=o, config_n=n), rows, n, x)
            for replay in range(2):
                fresh = special_matrix(rows, n, dtype, seed + 1000 + replay).cuda()
                source.copy_(tp.take(fresh, dim=1))
                x.copy_(special_matrix(rows, 64, dtype, seed + 2000 + replay).nan_to_num(0, 1, -1).cuda())
                graph.replay()
                torch.cuda.synchronize()
                wants = {"kept buffer": fresh, "buffer met in capture": fresh}
                if "GEMM into the buffer" in outs:
                    wants["GEMM into the buffer"] = torch.cat([linear(x, w, config_n=n) for w in weights], 1)
                for what, want_now in wants.items():
                    problem = same_bits(outs[what], want_now)
                    if problem:
                        found.append(f"gather {name}, {what} (CUDA graph replay {replay}): {problem}")
    errors[rank] = found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gather_is_exact_on_every_path():
    pytest.importorskip("vllm")
    import random

    import torch.multiprocessing as mp

    rng = random.Random(7)
    cases = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows in (1, rng.randint(2, 64), rng.randint(65, 512)):
            n = rng.choice([rng.randint(8, 5000) * 2, rng.randint(8, 5000) * 2 + 1])  # uneven blocks too
            cases.append((rows, n, dtype, rng.randrange(1 << 30)))
    cases.append((4096, 8192 + 8, torch.bfloat16, 11))  # 64 MiB, past the custom all-reduce's limit (8 MiB at most): the all-gather
    manager = mp.get_context("spawn").Manager()
    errors = manager.dict()
    mp.start_processes(_worker, args=(_free_port(), cases, errors), nprocs=WORLD, start_method="spawn")
    found = [f"rank {r}: {e}" for r in range(WORLD) for e in errors.get(r, ["no result"])]
    assert not found, "\n".join(found)
