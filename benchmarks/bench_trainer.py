"""Trainer forward+backward throughput: the shared (vexact) model against stock transformers.

    python benchmarks/bench_trainer.py [--shape 1.7b|30b-a3b-4l|moonlight-4l|tiny|tiny-moe|tiny-deepseek] [--batch 8]
        [--seq-len 1024] [--steps 10]
        [--warmup 3] [--stock sdpa-padded,sdpa-packed] [--json OUT] [--profile N]

One step = forward, token log-probs of the next token, loss = -mean(log-probs), backward; gradients
are set to None between steps, no optimizer. Rows:
- vexact: `AutoModelForCausalLM.from_config` under `transformers_hooks.installed()`, a `PackedBatch` of
  the B sequences, `packed_log_probs` (the fused, row-chunked lm_head log-prob, with its gradient).
- stock-*: transformers' own class (Qwen3ForCausalLM; Qwen3MoeForCausalLM asked for its grouped_mm
  experts, the eager loop where this torch lacks grouped GEMMs, the "experts" field says which;
  DeepseekV3ForCausalLM likewise for the DeepSeek shapes); bf16 logits -> fp32 -> log_softmax -> gather (the
  way verl scores tokens without flash-attn's cross-entropy kernel). `sdpa-padded`: [B, L] with an
  all-ones attention_mask (equal lengths, so no padding: SDPA runs causal, flash backend on CUDA);
  `sdpa-packed`: [1, T] with position_ids restarting per sequence (transformers builds a
  block-diagonal mask, but only with use_cache=False, which verl passes: with a cache it ignores
  the packing); `flex-packed`: the same with attn_implementation="flex_attention".
Every model gets the same seeded weights (by sorted parameter name), so the loss column must agree
to bf16 rounding (use a larger --init-std to make that check sharp: at 0.02 every loss is ~log V). "vs stock" is tokens/s over the fastest stock row's. "[T,V]" says whether any
tensor of T x V (or more) elements ending in the vocabulary dimension was created during one
step (checked in an extra, untimed step): the fused log-prob never makes one.
Timing: CUDA events around each step after `--warmup` steps (the Triton kernels compile on first
use), peak memory from torch.cuda.max_memory_allocated (weights and gradients included).
`--profile N`: one more step of each path under torch.profiler, its N ops with the most self time on
the device (on the CPU without CUDA), with their share of the step: where a path's time goes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
import traceback

import torch
from bench_env import print_ops, top_ops
from torch.utils._python_dispatch import TorchDispatchMode

from vexact_vllm.model_patches import PackedBatch
from vexact_vllm.model_patches.trainers import transformers_hooks
from vexact_vllm.model_shapes import MOONLIGHT_16B_A3B_SHAPE, QWEN3_1_7B_SHAPE, QWEN3_30B_A3B_SHAPE
from vexact_vllm.tiny_model import shape_config

TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=4096,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6,
)  # fmt: skip
TINY_MOE_SHAPE = dict(TINY_SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[0])
# DeepSeek-V3's layout in small: MLA (q LoRA, 16 + 8 / 16 heads over a 32 + 8 latent), layer 0 dense, then
# 8 experts top-2 in 4 groups (2 kept) with sigmoid scores, one shared expert.
TINY_DEEPSEEK_SHAPE = dict(
    TINY_SHAPE, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    topk_method="noaux_tc", scoring_func="sigmoid",
)  # fmt: skip
del TINY_DEEPSEEK_SHAPE["head_dim"]
# name: (model_type, fields); 30b-a3b-4l is Qwen3-30B-A3B's shape with 4 of its 48 layers (fits one GPU),
# moonlight-4l Moonlight-16B-A3B's with 4 of its 27 (the first dense, as in the model)
SHAPES = {
    "1.7b": ("qwen3", QWEN3_1_7B_SHAPE), "tiny": ("qwen3", TINY_SHAPE),
    "30b-a3b-4l": ("qwen3_moe", dict(QWEN3_30B_A3B_SHAPE, num_hidden_layers=4)),
    "tiny-moe": ("qwen3_moe", TINY_MOE_SHAPE),
    "moonlight-4l": ("deepseek_v3", dict(MOONLIGHT_16B_A3B_SHAPE, num_hidden_layers=4)),
    "tiny-deepseek": ("deepseek_v3", TINY_DEEPSEEK_SHAPE),
}
STOCK = {"sdpa-padded": ("sdpa", False), "sdpa-packed": ("sdpa", True), "flex-packed": ("flex_attention", True)}
INIT_STD = 0.02


def build(config, device, attn: str | None, std: float = INIT_STD):
    """The vexact model (attn None) or transformers' own class with `attn`; seeded bf16 weights:
    matrices ~ N(0, std) drawn in sorted-name order, norms 1 (the same values in both classes)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        if attn is None:
            with transformers_hooks.installed():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        elif getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None):
            # MoE: the fastest experts path transformers has here
            try:
                model = AutoModelForCausalLM.from_config(
                    config, dtype=torch.bfloat16, attn_implementation=attn, experts_implementation="grouped_mm"
                )
            except (ValueError, ImportError) as e:
                print(f"transformers' grouped_mm experts unavailable ({e}); stock runs the eager loop")
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, std, generator=gen)
    return model.train()


def vexact_step(model, batch: PackedBatch):
    loss = -model.packed_log_probs(batch).mean()
    loss.backward()
    return loss


def stock_step(model, batch: PackedBatch, packed: bool, b: int, length: int):
    targets, valid = batch.next_tokens()  # [T]
    if packed:
        out = model(input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False)
    else:
        ids = batch.input_ids.view(b, length)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    logits = out.logits.reshape(-1, out.logits.shape[-1]).float()  # [T, V] fp32
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]  # [T]
    loss = -torch.where(valid, logp, torch.zeros_like(logp)).mean()
    loss.backward()
    return loss


class _LargestVocabTensor(TorchDispatchMode):
    """Records the most elements of any op output whose last dimension is the vocabulary size."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def measure(step, model, steps: int, warmup: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            loss = step()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"ms_mean": statistics.fmean(times), "ms_median": statistics.median(times), "ms_all": times,
            "peak_gib": peak, "loss": float(loss.detach())}


def run_path(name, config, batch, args, device) -> dict:
    attn, packed = (None, True) if name == "vexact" else STOCK[name.removeprefix("stock-")]
    model = build(config, device, attn, args.init_std)
    if name == "vexact":
        step = functools.partial(vexact_step, model, batch)
    else:
        step = functools.partial(stock_step, model, batch, packed, args.batch, args.seq_len)
    experts = getattr(model.config, "_experts_implementation", None) if attn else None
    row = {"path": name, "attn": attn or "vexact varlen", "experts": experts, **measure(step, model, args.steps, args.warmup, device)}
    row["tokens_per_s"] = batch.input_ids.numel() / (row["ms_mean"] / 1e3)
    if not args.no_logits_check:
        model.zero_grad(set_to_none=True)
        try:
            with _LargestVocabTensor(config.vocab_size) as spy:
                step()
            row["largest_vocab_tensor"] = spy.largest
            row["full_logits"] = spy.largest >= batch.input_ids.numel() * config.vocab_size
        except Exception:  # the check must not cost the timing row
            traceback.print_exc()
    if args.profile:
        model.zero_grad(set_to_none=True)
        row["profile"] = top_ops(step, device.type == "cuda", args.profile)
    return row


def print_table(rows, header):
    stock = [r["tokens_per_s"] for r in rows if r["path"].startswith("stock") and "error" not in r]
    best = max(stock, default=float("nan"))
    print(header)
    print(f"{'path':18s} {'tokens/s':>10s} {'ms/step':>9s} {'peak GiB':>9s} {'vs stock':>8s} {'loss':>9s} {'[T,V]':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['path']:18s} ERROR: {r['error'].strip().splitlines()[-1]}")
            continue
        r["vs_stock"] = r["tokens_per_s"] / best
        full = {None: "-", True: "yes", False: "no"}[r.get("full_logits")]
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{r['path']:18s} {r['tokens_per_s']:10.0f} {r['ms_mean']:9.2f} {peak:>9s} "
              f"{r['vs_stock']:8.2f} {r['loss']:9.4f} {full:>6s}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (Triton compiles on first use)")
    parser.add_argument("--stock", default="sdpa-padded,sdpa-packed", help=f"comma list of {','.join(STOCK)}")
    parser.add_argument("--init-std", type=float, default=INIT_STD, help="std of the random weights")
    parser.add_argument("--skip-vexact", action="store_true")
    parser.add_argument("--no-logits-check", action="store_true", help="skip the extra [T,V] check step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile one step of each path and print its N ops with the most device time")
    args = parser.parse_args(argv)
    if args.profile < 0:
        parser.error(f"--profile takes a number of ops, got {args.profile}")
    stock = [s for s in args.stock.split(",") if s]
    if unknown := [s for s in stock if s not in STOCK]:
        parser.error(f"unknown --stock {unknown}; expected {list(STOCK)}")
    device = torch.device(args.device)
    config = shape_config(*SHAPES[args.shape], special_id=0)
    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=gen).tolist()
    batch = PackedBatch.from_sequences(seqs, device=device)

    rows = []
    for name in ([] if args.skip_vexact else ["vexact"]) + [f"stock-{s}" for s in stock]:
        try:
            rows.append(run_path(name, config, batch, args, device))
        except Exception:  # one path failing (e.g. out of memory) must not hide the others
            traceback.print_exc()
            rows.append({"path": name, "error": traceback.format_exc(limit=3)})
        gc.collect()  # a failed path's model goes before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = (f"\n{dev}, torch {torch.__version__}, shape {args.shape}, {args.batch} x {args.seq_len} tokens, "
              f"{args.steps} steps after {args.warmup} warm-up")
    print_table(rows, header)
    for r in rows:
        if "profile" in r:
            print_ops(f"{r['path']}: the ops with the most self time in one step", r["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=1)
    return 0 if rows and not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
