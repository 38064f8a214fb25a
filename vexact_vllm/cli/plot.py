"""`vexact-vllm check --plot FILE`: per-position |log-prob difference| against the trainer.

One panel per row of the report (stock vLLM beside vexact), the generated-token index on x and the
absolute difference on a symlog y axis, so exact zeros and small differences both show.
"""

from __future__ import annotations


def plot_differences(rows, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise SystemExit("error: --plot needs matplotlib: pip install 'vexact-vllm[plot]'") from err

    fig, axes = plt.subplots(len(rows), 1, figsize=(8, 1.8 * len(rows) + 0.6), sharex=True, squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        c = row.comparison
        xs, ys = zip(*c.per_position) if c.per_position else ((), ())
        ax.scatter(xs, ys, s=6, color="tab:red" if c.mismatches else "tab:green")
        ax.set_yscale("symlog", linthresh=1e-7)
        ax.set_ylim(-1e-8, max(1e-6, c.max_abs_diff * 2))
        ax.set_title(f"{row.engine}: {row.composition} ({c.mismatches}/{c.tokens} tokens differ)", fontsize=9)
        ax.set_ylabel("|diff|")
    axes[-1, 0].set_xlabel("generated token index")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
