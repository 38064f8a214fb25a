"""The report side of benchmarks/bench_gated_delta.py: the printed
table and the docs/results.jsonl rows (scripts/results_page.py's fields: id, section, title, date,
device, commit, command, metric, value, notes) that summarise a run for the lead to paste.
"""

from __future__ import annotations


def fmt(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    lines = [f"{'case':8} {'hv':>3} {'size':>12}  {'system':14} {'fwd ms':>10} {'vs ref':>6} "
             f"{'fwd+bwd ms':>11} {'vs ref':>6} {'tok/s':>10} {'max |o - C|':>11}"]  # fmt: skip
    for r in rows:
        if r["case"] == "check":
            verdict = (
                "decode == training" if r["decode_equals_training"] else f"DIFFERS: {r['first_difference']}"
            )
            lines.append(f"{'check':8} {r['v_heads']:>3} {'':>12}  {r['system']:14} {verdict}")
            continue
        head = f"{r['case']:8} {r['v_heads']:>3} {r['size']:>12}  {r['system']:14}"
        if "skipped" in r or "error" in r:
            lines.append(f"{head} {r.get('skipped') or 'ERROR: ' + r['error']}")
            continue
        lines.append(
            f"{head} {fmt(r['fwd_ms']):>10} {fmt(r.get('fwd_vs_ref'), '.2f'):>6} "
            f"{fmt(r.get('fwd_bwd_ms')):>11} {fmt(r.get('fwd_bwd_vs_ref'), '.2f'):>6} "
            f"{fmt(r.get('tokens_per_s'), '.3g'):>10} {fmt(r.get('max_abs_diff_vs_c'), '.2e'):>11}"
        )
    return "\n".join(lines)


def _device_tag(name: str) -> str:
    lower = name.lower()
    return next(
        (g for g in ("h200", "h100", "b200", "a100") if g in lower), "gpu" if "nvidia" in lower else "cpu"
    )


def results_rows(report: dict) -> list[dict]:
    """docs/results.jsonl rows (scripts/results_page.py's fields) summarising a report: training,
    prefill, decode and the decode == training check, one row each (ids gdn-CASE-DEVICE)."""
    env, rows = report["environment"], report["rows"]
    tag = _device_tag(env["device"])
    absent = sorted({r["system"] for r in rows if "skipped" in r})
    failed = sorted({r["system"] for r in rows if "error" in r})
    common = {
        "section": "Gated DeltaNet kernels",
        "date": env["date"][:10],
        "device": f"{env['device']}, torch {env['torch']}, Triton {env['triton']}, vLLM {env['vllm'] or 'absent'}, "
        f"fla {env['fla'] or 'absent'}",
        "commit": (env["commit"] or "unknown")[:7],
        "command": env["command"],
    }
    shape = report["shape"]
    heads = f"{shape['hk']} k heads, d_k = d_v = {shape['dk']}, bf16"
    notes = (
        f"{heads}. Absent baselines: {', '.join(absent) or 'none'}; failed: {', '.join(failed) or 'none'}."
    )

    def cells(case, value_of, unit):
        parts = {}
        for r in rows:
            if r["case"] == case and "fwd_ms" in r:
                text = value_of(r)
                if text is not None:
                    size = f"{r['size']} sequences" if case == "decode" else r["size"]
                    parts.setdefault((r["v_heads"], size), []).append(f"{r['system']} {text}")
        return "; ".join(f"{hv} v heads, {size}: {', '.join(p)} {unit}" for (hv, size), p in parts.items())

    def train(r):
        return f"{r['fwd_ms']:.2f} / {fmt(r.get('fwd_bwd_ms'), '.2f')}"

    checks = [r for r in rows if r["case"] == "check"]
    verdicts = "; ".join(
        f"{r['system']} at {r['v_heads']} v heads: "
        + ("equal" if r["decode_equals_training"] else r["first_difference"])
        for r in checks
    )
    out = [
        {"id": f"gdn-train-{tag}", "title": "Gated DeltaNet training step, C / fla / vLLM",
         "metric": "ms, forward / forward+backward (-: no backward timed)",
         "value": cells("train", train, "ms")},
        {"id": f"gdn-prefill-{tag}", "title": "Gated DeltaNet prefill from empty states",
         "metric": "tokens/s", "value": cells("prefill", lambda r: f"{r['tokens_per_s']:.3g}", "tok/s")},
        {"id": f"gdn-decode-{tag}", "title": "Gated DeltaNet decode step (C@p: p rows of a partial chunk held)",
         "metric": "us per step", "value": cells("decode", lambda r: f"{r['fwd_ms'] * 1e3:.1f}", "us")},
    ]  # fmt: skip
    if checks:
        ok = all(r["decode_equals_training"] for r in checks)
        out.append({"id": f"gdn-bitwise-{tag}", "title": "Gated DeltaNet decode == training forward, bit for bit",
                    "metric": "token-by-token decode against the packed training forward (torch.equal)",
                    "value": ("PASS: " if ok else "DIFFERS: ") + verdicts,
                    "notes": f"lengths {checks[0]['lengths']}. {notes}"})  # fmt: skip
    return [{**{"id": r["id"]}, **common, **{k: v for k, v in r.items() if k != "id"}, **({} if "notes" in r else {"notes": notes})}
            for r in out if r["value"]]  # fmt: skip
