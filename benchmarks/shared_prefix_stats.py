"""How many decode sequences the shared-prompt groups take in a real engine (VEXACT_SHARED_PREFIX=1).

    python benchmarks/shared_prefix_stats.py [--model qwen3-1.7b-shape] [--workload grpo:32] [BENCH OPTIONS]

One `vexact-vllm bench` run of the vexact-shared-prefix configuration in this process (vLLM's engine
core in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0), with the attention builder's
`shared_prefix_groups` wrapped to count, at every metadata build outside a CUDA-graph capture: the
requests, the decodes, the grouped sequences, the groups, and the key tiles the groups read once
against the key tiles the grouped sequences read in all. The counts synchronise the host (this is a
diagnostic, not a timing); the printed table is per engine step band. Speed: `vexact-vllm bench
--configs vexact,vexact-shared-prefix`.
"""

from __future__ import annotations

import os
import sys

import torch

STEPS: list[tuple[int, int, int, int, int, int]] = []


def _wrap(groups_fn):
    def counted(block_table, seq_lens, query_start_loc, page, max_members, out=None):
        shared = groups_fn(block_table, seq_lens, query_start_loc, page, max_members, out=out)
        if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
            q_lens = query_start_loc[1:] - query_start_loc[:-1]
            grouped = shared.tiles > 0
            STEPS.append((
                seq_lens.shape[0], int((q_lens == 1).sum()), int(grouped.sum()), int((shared.members > 0).sum()),
                int(shared.tiles[grouped].sum()), int((seq_lens[grouped] // 64).sum()),
            ))  # fmt: skip
        return shared

    return counted


def main() -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VEXACT_SHARED_PREFIX"] = "1"
    os.environ["VEXACT_KEY_SPLIT"] = "0"  # the groups take no key split (on by default)
    from vexact_vllm import attention
    from vexact_vllm.cli import bench

    attention.shared_prefix_groups = _wrap(attention.shared_prefix_groups)
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--workload", "grpo:32", "--duration", "0", "--warmup-passes", "0", *sys.argv[1:], "--config", "vexact-shared-prefix"]
    )
    args.model = bench.resolve_model(args.model, args.load_format)
    args.vocab_limit = args.vocab_limit or bench._vocab_size(args.model)
    bench.apply_workload(args)
    record = bench.run_one(args)
    print(f"{record['output_tokens']} tokens in {record['elapsed_s']:.1f} s ({record['output_tok_s']:.0f} tok/s)")
    print(f"{len(STEPS)} builds; per band of builds: requests, decodes, grouped, groups, tiles read once / by each")
    band = max(1, len(STEPS) // 12)
    for i in range(0, len(STEPS), band):
        rows = STEPS[i : i + band]
        s = [sum(r[j] for r in rows) / len(rows) for j in range(6)]
        share = s[4] / s[5] if s[5] else 0.0
        print(f"builds {i:5d}-{i + len(rows) - 1:5d}: requests {s[0]:6.1f} decodes {s[1]:6.1f} grouped {s[2]:6.1f} "
              f"groups {s[3]:5.1f} tiles once {s[4]:8.1f} of {s[5]:8.1f} ({share:.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
