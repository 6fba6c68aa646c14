"""Plumbing shared by the benchmark scripts: child processes, medians, RESULTS.md, PNGs.

Not a benchmark itself (`make bench` runs the scripts listed in the Makefile). Every script:
- runs each measurement in a fresh child process (`run_child`), so each side gets its own
  OpenMP thread team and a clean allocator, and alternates the sides within every repeat;
- prints its tables (markdown, readable on a console) and writes its own section of
  `benchmarks/RESULTS.md` (`write_section`) with the machine, versions, date and command;
- with `--quick` (smoke mode: tiny sizes, one repeat) writes to `benchmarks/results/quick/`
  instead, which git ignores, so smoke numbers never overwrite the committed results.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULT_MARK = "BENCH_RESULT "

# Order of the sections in RESULTS.md, whichever script ran last.
SECTIONS = (
    "sft_throughput",
    "grpo_learning",
    "grpo_update",
    "rollout_throughput",
    "agent_proxy",
    "engine_throughput",
    "prefix_cache",
    "prefix_cache_small",
    "weight_sync",
    "rl_scaling",
    "rl_algorithms",
    "rl_ppo",
    "engine_abuse",
    "checkpoint_kill",
    "distributed_scaling",
    "lora",
    "lora_small",
    "demo",
    "demo_history",  # written by hand, not by a script: how the demo's settings were chosen
    "gpu_check",
    "controller_scale",
    "fault_matrix",
    "fault_matrix_workers",
)


def results_dir(quick: bool) -> Path:
    """Where RESULTS.md and the PNGs go: committed results, or the ignored smoke folder."""
    out = BENCH_DIR / "results" / "quick" if quick else BENCH_DIR / "results"
    out.mkdir(parents=True, exist_ok=True)
    return out


def results_md(quick: bool) -> Path:
    return results_dir(quick) / "RESULTS.md" if quick else BENCH_DIR / "RESULTS.md"


def apply_quick(args: Any, parser: Any, **values: Any) -> None:
    """Smoke-mode settings, for every option the command line left at its default."""
    for name, value in values.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)


def median(values: Iterable[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else "unknown CPU"


def machine_line() -> str:
    """One line naming the machine and the versions that decide the numbers."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} cores ({cpu_model()}), Python {platform.python_version()}, "
        f"torch {version_of('torch')}, transformers {version_of('transformers')}, "
        f"trl {version_of('trl')}; load average at start {load}"
    )


def command_line() -> str:
    """The exact command that produced the results (interpreter relative to the repo)."""
    exe, script = Path(sys.executable), Path(sys.argv[0]).resolve()
    return shlex.join([_relative(exe), _relative(script), *sys.argv[1:]])


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def publish(key: str, title: str, label: str, parts: list[str], notes: list[str], *,
            quick: bool, started: float, image: str = "") -> Path:  # fmt: skip
    """Print `label`, `parts` (e.g. a header line and a table) and `notes` to the terminal,
    and write them (plus an optional image link) as this script's section of RESULTS.md."""
    print(f"\n{label}\n" + "\n".join(parts) + "\n" + "\n".join(notes))
    body = "\n\n".join(parts) + "\n\n" + "\n".join(notes) + (f"\n\n{image}" if image else "")
    return write_section(key, title, body, quick=quick, started=started)


def write_section(key: str, title: str, body: str, *, quick: bool, started: float,
                  path: Path | None = None, smoke: str = "") -> Path:  # fmt: skip
    """Replace (or add) this script's section of RESULTS.md, keeping the others.

    Args:
        key: one of SECTIONS; the section lives between HTML comment markers with this key.
        title: the section heading.
        body: markdown (tables, notes, image links relative to RESULTS.md).
        started: time.time() when the measurement began (the section shows its date).
        path: the RESULTS.md to write (default: `results_md(quick)`).
        smoke: the warning a smoke run's section starts with (default: the `--quick` one).
    """
    path = path or results_md(quick)
    when = dt.datetime.fromtimestamp(started, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    took = time.time() - started
    if quick:
        smoke = smoke or "Smoke run (`--quick`): not comparable to the full results."
    smoke = f"**{smoke}**\n\n" if smoke else ""
    section = (
        f"<!-- begin {key} -->\n## {title}\n\n{smoke}"
        f"- Machine: {machine_line()}\n- Date: {when} (took {took / 60:.1f} min)\n"
        f"- Command: `{command_line()}`\n\n{body.strip()}\n<!-- end {key} -->\n"
    )
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    sections = dict(re.findall(r"<!-- begin (\w+) -->\n(.*?)<!-- end \1 -->\n", text, re.S))
    sections = {k: f"<!-- begin {k} -->\n{v}<!-- end {k} -->\n" for k, v in sections.items()}
    sections[key] = section
    order = [k for k in SECTIONS if k in sections] + [k for k in sections if k not in SECTIONS]
    header = (
        "# Benchmark results\n\n"
        "Written by the scripts in `benchmarks/` (`make bench` runs them all; each script "
        "replaces only its own section). Every figure is a median over alternating repeats "
        "measured side by side in one run on the machine named in its section; ratios are "
        "ours / theirs unless the table says otherwise.\n\n"
    )
    path.write_text(header + "\n".join(sections[k] for k in order), encoding="utf-8")
    print(f"wrote section {key!r} of {path}")
    return path


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table with aligned columns (readable as plain text on a console too)."""
    cells = [[str(h) for h in headers], *[[_fmt(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def verdict(value: float, target: float, *, higher_is_better: bool = True) -> str:
    ok = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    return f"{value:.2f}x ({'met' if ok else 'MISSED'}: target {sign} {target}x)"


def run_child(args: Sequence[str], *, timeout_s: float = 1800, env: dict | None = None) -> dict:
    """Run `python <args>` and return the JSON object it printed after RESULT_MARK.

    Raises:
        RuntimeError: the child failed or printed no result (message has its stderr tail).
    """
    cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})}, cwd=REPO)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-30:])
        raise RuntimeError(f"benchmark child failed ({proc.returncode}): {shlex.join(cmd)}\n{tail}")
    return json.loads(lines[-1][len(RESULT_MARK) :])


def emit(result: dict) -> None:
    """Print a child's result where `run_child` finds it."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def peak_rss_mb_self() -> float:
    """Peak resident memory of this process so far (MiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) of a running process (MiB), NaN if unreadable."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    match = re.search(r"^VmHWM:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


def save_figure(fig: Any, name: str, quick: bool) -> Path:
    """Save a matplotlib figure as results/<name>.png; returns its path."""
    path = results_dir(quick) / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")
    return path


def pyplot() -> Any:
    """matplotlib.pyplot with a non-interactive backend, or None when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
        return None
    return plt


def curves_png(path: Path, curves: dict[str, Sequence[tuple[float, float]]], *, xlabel: str,
               ylabel: str, title: str,
               hlines: Sequence[tuple[float, str, str]] = ()) -> Path | None:  # fmt: skip
    """Line plot of named (x, y) curves (y already in display units) with optional horizontal
    reference lines (y, linestyle, label), written to `path`; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in curves.items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker=".", label=name)
    for y, style, label in hlines:
        ax.axhline(y, color="grey", ls=style, lw=0.8, label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def image_link(path: Path | None, quick: bool, alt: str) -> str:
    """A markdown image reference relative to RESULTS.md."""
    if path is None:
        return ""
    base = results_md(quick).parent
    return f"![{alt}]({path.relative_to(base).as_posix()})\n"
