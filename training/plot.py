"""Plotting and printing training curves (matplotlib is optional: the `plot` extra).

python -m training.plot RUN_DIR [--keys reward_mean,loss]   # writes RUN_DIR/curves.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

_BARS = " ▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float]) -> str:
    """A one-line text chart of `values` (NaNs shown as spaces)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    return "".join(
        " " if not math.isfinite(v) else _BARS[1 + int((v - lo) / span * (len(_BARS) - 2))]
        for v in values
    )


def print_curve(title: str, values: Sequence[float], *, chunks: int = 10) -> None:
    """Print a sparkline and the mean of `values` over `chunks` consecutive windows."""
    if not values:
        return
    size = max(1, math.ceil(len(values) / chunks))
    means = [
        sum(values[i : i + size]) / len(values[i : i + size]) for i in range(0, len(values), size)
    ]
    print(f"{title} ({len(values)} steps): {sparkline(values)}")
    print("  window means: " + " ".join(f"{m:.3f}" for m in means))


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def plot_training_curves(metrics_path: str | Path, out_png: str | Path,
                         keys: Sequence[str] = ("reward_mean", "eval_accuracy", "loss")
                         ) -> Path | None:  # fmt: skip
    """One panel per key present in `metrics.jsonl`; returns the PNG path (None: no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [json.loads(x) for x in Path(metrics_path).read_text(encoding="utf-8").splitlines() if x]
    present = [k for k in keys if any(k in r for r in rows)]
    if not present:
        return None
    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.6 * len(present)), squeeze=False)
    for ax, key in zip(axes[:, 0], present, strict=True):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_reward_png(values: Sequence[float], out_png: str | Path) -> Path | None:
    """Reward per step as a PNG, when matplotlib is installed (else None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not values:
        return None
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(range(1, len(values) + 1), values)
    ax.set_xlabel("step")
    ax.set_ylabel("reward_mean")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot metrics.jsonl of a run directory.")
    parser.add_argument("run_dir")
    parser.add_argument("--keys", default="reward_mean,eval_accuracy,loss,eval_loss,accuracy")
    args = parser.parse_args(argv)
    out = plot_training_curves(Path(args.run_dir) / "metrics.jsonl",
                               Path(args.run_dir) / "curves.png", args.keys.split(","))  # fmt: skip
    if out is None:
        print("nothing plotted (install matplotlib: pip install -e '.[plot]')", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
