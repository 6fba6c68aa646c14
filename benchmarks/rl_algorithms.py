"""Held-out accuracy and clipping of RL variants on the tiny arithmetic task, side by side.

Each arm is `examples/run_rl.py --config configs/rl_tiny.yaml --max-steps N <overrides>`, run in
its own process from the same SFT checkpoint; repeats differ in the RL prompt order
(`data.shuffle_seed`) and alternate the arms. Printed per arm (median over repeats): held-out
greedy accuracy before/after, the mean clip fraction and KL to the behaviour policy over the
steps, and the wall time of the RL part.

    .venv/bin/python benchmarks/rl_algorithms.py [--steps 200] [--repeats 3] [--arms grpo,grpo_mb4]
    .venv/bin/python benchmarks/rl_algorithms.py --arms grpo,ppo_mb4 --section rl_ppo
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO, apply_quick, md_table, median, publish

ARMS = {
    "grpo": [],
    "grpo_mb4": ["train.mini_batches=4"],
    "dapo": ["algorithm.preset=dapo"],
    "dapo_mb4": ["algorithm.preset=dapo", "train.mini_batches=4"],
    "ppo": ["algorithm.preset=ppo"],
    "ppo_mb4": ["algorithm.preset=ppo", "train.mini_batches=4"],
}
SUMMARY = re.compile(
    r"RL done: heldout_accuracy before=([\d.]+)% after=([\d.]+)%.*wall_time=([\d.]+)s"
)


def run_arm(arm: str, repeat: int, steps: int, out_root: Path) -> dict:
    out = out_root / f"{arm}_r{repeat}"
    cmd = [sys.executable, "examples/run_rl.py", "--config", "configs/rl_tiny.yaml",
           "--max-steps", str(steps), "--output-dir", str(out), f"data.shuffle_seed={repeat}",
           "train.eval_every=50", *ARMS[arm]]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(
            f"{arm} repeat {repeat} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    match = SUMMARY.search(proc.stdout + proc.stderr)
    if match is None:
        raise SystemExit(f"{arm}: no summary line in the output:\n{proc.stdout[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def mean(key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.fmean(values) if values else float("nan")

    return {
        "before": float(match.group(1)), "after": float(match.group(2)),
        "rl_wall_s": float(match.group(3)), "process_s": time.perf_counter() - t0,
        "clip_fraction": mean("clip_fraction"), "kl_to_old_last": mean("kl_to_old_last"),
        "s_per_step": mean("time_step_s"),
        "curve": _curve(rows),
    }  # fmt: skip


def _curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, seconds of RL steps so far, held-out accuracy) at each evaluation."""
    out, elapsed = [], 0.0
    for r in rows:
        elapsed += r.get("time_step_s", 0.0)
        if "eval_accuracy" in r:
            out.append((r["step"], elapsed, 100 * r["eval_accuracy"]))
    return out


def curve_table(results: dict[str, list[dict]]) -> str:
    """Held-out accuracy against the time spent in RL steps (medians over repeats)."""
    rows = []
    for arm, rs in results.items():
        for k, (step, _, _) in enumerate(rs[0]["curve"]):
            points = [r["curve"][k] for r in rs if len(r["curve"]) > k]
            rows.append([arm, step, f"{median(p[1] for p in points):.0f}",
                         f"{median(p[2] for p in points):.1f} %"])  # fmt: skip
    return md_table(["arm", "step", "RL step time so far (s)", "held-out accuracy"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", default="grpo,grpo_mb4,dapo,dapo_mb4")
    parser.add_argument("--section", default="rl_algorithms", choices=["rl_algorithms", "rl_ppo"],
                        help="RESULTS.md section to write (one per comparison)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 steps, 1 repeat")
    args = parser.parse_args()
    apply_quick(args, parser, steps=10, repeats=1) if args.quick else None
    started = time.time()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {sorted(ARMS)}")
    out_root = REPO / "runs" / "bench_rl_algorithms"
    results: dict[str, list[dict]] = {a: [] for a in arms}
    for repeat in range(args.repeats):
        for arm in arms:
            r = run_arm(arm, repeat, args.steps, out_root)
            results[arm].append(r)
            print(f"{arm} r{repeat}: before {r['before']:.1f}% after {r['after']:.1f}% "
                  f"clip {r['clip_fraction']:.4f} rl {r['rl_wall_s']:.0f}s", flush=True)  # fmt: skip
    rows = []
    for arm in arms:
        rs = results[arm]
        rows.append([
            arm, " ".join(ARMS[arm]) or "(rl_tiny.yaml)", f"{median(r['before'] for r in rs):.1f} %",
            f"{median(r['after'] for r in rs):.1f} %",
            " / ".join(f"{r['after']:.1f}" for r in rs),
            f"{median(r['clip_fraction'] for r in rs):.4f}",
            f"{median(r['kl_to_old_last'] for r in rs):.2e}",
            f"{median(r['s_per_step'] for r in rs):.3f}", f"{median(r['rl_wall_s'] for r in rs):.0f}",
        ])  # fmt: skip
    table = md_table(["arm", "overrides", "held-out before", f"after {args.steps} steps (median)",
                      "after, each repeat", "clip fraction (mean over steps)",
                      "KL to old, last update", "s/step", "RL wall s"], rows)  # fmt: skip
    notes = [f"- {args.repeats} repeats (RL prompt order `data.shuffle_seed` = repeat), arms "
             "alternating; the same SFT checkpoint for all; held-out greedy accuracy on 500 "
             "problems."]  # fmt: skip
    title = {"rl_algorithms": "RL variants on the tiny task: mini-batches and DAPO",
             "rl_ppo": "PPO with a critic next to GRPO on the tiny task"}[args.section]  # fmt: skip
    publish(args.section, title, args.section, [table, curve_table(results)], notes,
            quick=args.quick, started=started)  # fmt: skip


if __name__ == "__main__":
    main()
