"""`vexact-vllm check --plot FILE`: per-position |log-prob difference| against the trainer.

One panel per engine (vexact, then stock vLLM beside it when --against-stock), one series per
composition: the generated-token index on x, |vLLM log-prob - trainer log-prob| on a log y axis.
Exact zeros cannot sit on a log axis, so they are drawn on a floor line at the bottom labelled
"0 (exact)", below every nonzero difference: a bit-exact engine is a flat line on the floor.
"""

from __future__ import annotations

import math

ENGINE_ORDER = ("vexact", "stock")


def require_matplotlib():
    """matplotlib.pyplot with the Agg backend, or a SystemExit that says how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit(
            "error: --plot needs matplotlib, which is not installed here: pip install matplotlib "
            "(or 'vexact-vllm[plot]'), or leave out --plot"
        ) from err
    return plt


def zero_floor(rows) -> float:
    """Where exact zeros are drawn: a decade below the smallest nonzero difference (1e-9 at most)."""
    nonzero = [d for r in rows for _, d in r.comparison.per_position if d > 0]
    top = min(nonzero) if nonzero else 1e-8
    return min(1e-9, 10 ** (math.floor(math.log10(top)) - 1))


def plot_differences(rows, path: str) -> None:
    plt = require_matplotlib()
    engines = sorted({r.engine for r in rows}, key=lambda e: (ENGINE_ORDER + (e,)).index(e))
    floor = zero_floor(rows)
    top = max([r.comparison.max_abs_diff for r in rows] + [floor * 100])
    fig, axes = plt.subplots(1, len(engines), figsize=(6.5 * len(engines), 4.2), sharey=True, squeeze=False)
    markers = "os^vD<>px*h"
    for ax, engine in zip(axes[0], engines):
        mine = [r for r in rows if r.engine == engine]
        tokens = sum(r.comparison.tokens for r in mine)
        differ = sum(r.comparison.mismatches for r in mine)
        ax.set_yscale("log")
        ax.set_ylim(floor / 3, top * 3)  # fixed: all-zero data would autoscale to a singular range
        for k, row in enumerate(mine):
            c = row.comparison
            xs = [x for x, _ in c.per_position]
            ys = [d if d > 0 else floor for _, d in c.per_position]
            label = f"{row.composition}: {c.mismatches}/{c.tokens} differ"
            ax.scatter(xs, ys, s=10, marker=markers[k % len(markers)], alpha=0.6, label=label)
        ax.axhline(floor, color="0.5", lw=0.8, ls="--")
        ax.set_xlabel("generated token index")
        names = ", ".join(r.composition.split(" (")[0] for r in mine)
        ax.set_title(f"{engine} vs training forward: {differ} of {tokens} tokens differ\n({names})", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    axes[0, 0].set_ylabel("|vLLM log-prob - trainer log-prob|")
    ticks = [t for t in axes[0, 0].get_yticks() if floor * 10 <= t <= top * 3]
    axes[0, 0].set_yticks([floor, *ticks], ["0 (exact)", *(f"{t:.0e}" for t in ticks)])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
