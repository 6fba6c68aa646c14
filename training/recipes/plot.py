"""Plotting and printing training curves (matplotlib is optional: the `plot` extra).

rollouts plot RUN_DIR [--keys reward_mean,loss] [--out FILE]   # writes RUN_DIR/curves.png
(also `python -m training.recipes.plot RUN_DIR ...`)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from plumbing.errors import DataError, RolloutsError, import_extra

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


def window_means(values: Sequence[float], windows: int) -> list[float]:
    """Means of `values` over at most `windows` consecutive, equal-sized windows."""
    size = max(1, math.ceil(len(values) / windows))
    return [statistics.fmean(values[i : i + size]) for i in range(0, len(values), size)]


def print_curve(title: str, values: Sequence[float], *, chunks: int = 10, width: int = 60) -> None:
    """Print a sparkline (of at most `width` window means) and the means of `chunks` windows."""
    if not values:
        return
    print(f"{title} ({len(values)} steps): {sparkline(window_means(values, width))}")
    print("  window means: " + " ".join(f"{m:.3f}" for m in window_means(values, chunks)))


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


DEFAULT_KEYS = ("reward_mean", "eval_accuracy", "accuracy", "loss", "eval_loss", "kl", "grad_norm")


def plot_training_curves(metrics_jsonl: str | Path, out_png: str | Path | None = None,
                         keys: Sequence[str] | None = None, title: str | None = None
                         ) -> Path:  # fmt: skip
    """One panel per metric of a `metrics.jsonl` (as `JsonlLogger` writes it), against step.

    Args:
        metrics_jsonl: the metrics file.
        out_png: where to write; default `curves.png` beside the metrics file.
        keys: metrics to plot (those absent are skipped); default `DEFAULT_KEYS` plus every
            reward component (`reward/<name>`).
        title: the figure's title; default the run directory and its last step.

    Returns:
        The PNG path.

    Raises:
        MissingExtraError: matplotlib is not installed (the `plot` extra).
        DataError: none of the keys has a numeric value in the file.
    """
    mpl = import_extra("matplotlib", package="matplotlib", extra="plot",
                       feature="plot_training_curves")  # fmt: skip
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(metrics_jsonl)
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    if keys is None:
        components = sorted({k for r in rows for k in r if k.startswith("reward/")})
        keys = (*DEFAULT_KEYS, *components)
    present = distinct_series(rows, keys)
    if not present:
        raise DataError(f"{path}: no numeric values for any of {list(keys)}")
    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.6 * len(present)), squeeze=False)
    for ax, (key, pts) in zip(axes[:, 0], present.items(), strict=True):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    last = max((r["step"] for r in rows if _is_number(r.get("step"))), default=0)
    fig.suptitle(title or f"{path.parent.resolve().name}: {last} steps")
    fig.tight_layout()
    out = Path(out_png) if out_png is not None else path.with_name("curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def distinct_series(rows: Sequence[dict], keys: Sequence[str]) -> dict[str, list[tuple]]:
    """(step, value) points per key, leaving out absent keys and any series that repeats an
    earlier one (`reward/total` is `reward_mean`, `accuracy` is `reward/correct`): one panel
    per curve."""
    out: dict[str, list[tuple]] = {}
    for key in dict.fromkeys(keys):
        pts = [(r["step"], r[key]) for r in rows if _is_number(r.get(key))]
        if pts and pts not in out.values():
            out[key] = pts
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Plot the metrics.jsonl of a run directory."
    )
    parser.add_argument("run_dir", help="a run directory (or its metrics.jsonl)")
    parser.add_argument("--keys", default=None, help="comma-separated metrics (default: common)")
    parser.add_argument("--out", default=None, help="PNG path (default: beside metrics.jsonl)")
    args = parser.parse_args(argv)
    path = Path(args.run_dir)
    metrics = path if path.is_file() else path / "metrics.jsonl"
    keys = args.keys.split(",") if args.keys else None
    try:
        out = plot_training_curves(metrics, args.out, keys)
    except (RolloutsError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
