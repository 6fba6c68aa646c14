"""`make demo` under CPU kernel variants: does the demo's story hold on another machine?

    .venv/bin/python benchmarks/demo_variants.py [--variants a,b] [--jobs N] [--quick] [--collect]

Runs `examples/demo.py` (the whole demo: SFT on the imperfect teacher, GRPO and continued SFT
from its checkpoint) once per variant, each in its own process and output directory
(runs/demo_variants/NAME), and prints one row per variant: the SFT plateau (final held-out
accuracy and the spread of its last evals), RL's and continued SFT's accuracy and gain, and the
wall time of each phase. The variants change what a different CPU or install would change:
- `native`: the demo as `make demo` runs it (this CPU's own kernels, 2 threads, plain AdamW);
- `threads1`: SFT on 1 torch thread;
- `aten_default`: `ATEN_CPU_CAPABILITY=default` (torch's generic kernels instead of AVX2/512);
- `fused_adamw`: torch's fused AdamW (`optim.fused=true`) in both SFT phases.
`--jobs 2` runs two variants at once (each then gets one core: wall times are not a quiet
machine's, accuracies are unaffected). The load average is printed with the table.
`--collect` runs nothing: it tabulates the summary.json of variants already run (e.g. a
`make demo` run copied to runs/demo_variants/native/summary.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import REPO, md_table, publish

VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "native": ({}, []),
    "threads1": ({}, ["--sft", "backend.num_threads=1"]),
    "aten_default": ({"ATEN_CPU_CAPABILITY": "default"}, []),
    "fused_adamw": ({}, ["--sft", "optim.fused=true"]),
}
QUICK = ["--sft", "train.max_steps=40", "--sft", "train.eval_every=10", "--rl",
         "train.max_steps=4", "--rl", "train.eval_every=2"]  # fmt: skip


def run_variant(name: str, out_root: Path, extra: list[str]) -> dict:
    env, args = VARIANTS[name]
    out = out_root / name
    # Its own data and tiny model, so that variants running at once never share a file.
    own = [f"data.task_dir={out / 'data'}", f"model.tiny_dir={out / 'tiny_model'}"]
    own_args = [a for kv in own for a in ("--sft", kv)] + ["--rl", own[0]]
    cmd = [sys.executable, "examples/demo.py", "--out", str(out), *own_args, *args, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=3600)  # fmt: skip
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-20:])
        raise RuntimeError(f"variant {name} failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    summary = json.loads((out / "summary.json").read_text())
    return {"name": name, "total_s": time.perf_counter() - t0, **summary}


def collect(name: str, out_root: Path) -> dict:
    path = out_root / name / "summary.json"
    if not path.is_file():
        raise SystemExit(f"--collect: {path} does not exist (run the variant first)")
    summary = json.loads(path.read_text())
    total = sum(summary[k] or 0.0 for k in ("sft_wall_s", "rl_wall_s", "continued_wall_s"))
    return {"name": name, "total_s": total, **summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--jobs", type=int, default=1, help="variants run at once")
    parser.add_argument("--quick", action="store_true", help="smoke run: a few steps each")
    parser.add_argument("--collect", action="store_true", help="tabulate runs already made")
    args = parser.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    started = time.time()
    out_root = REPO / "runs" / ("demo_variants_quick" if args.quick else "demo_variants")
    load_before = os.getloadavg()[0]
    if args.collect:
        results = [collect(n, out_root) for n in names]
    else:
        with ThreadPoolExecutor(args.jobs) as pool:
            extra = QUICK if args.quick else []
            results = list(pool.map(lambda n: run_variant(n, out_root, extra), names))
    load_after = os.getloadavg()[0]
    rows = []
    for r in results:
        sft, mean = 100 * r["sft_accuracy"], 100 * r["plateau_mean"]
        rows.append([
            r["name"], f"{sft:.1f} %", f"{mean:.1f} % ({r['plateau_drift_points']:+.1f})",
            f"{100 * r['rl_accuracy']:.1f} % ({100 * r['rl_accuracy'] - mean:+.1f})",
            f"{100 * r['continued_accuracy']:.1f} % ({100 * r['continued_accuracy'] - mean:+.1f})",
            f"{r['sft_wall_s']:.0f}", f"{r['rl_wall_s']:.0f}", f"{r['continued_wall_s']:.0f}",
            f"{r['total_s']:.0f}",
        ])  # fmt: skip
    table = md_table(["variant", "SFT final", "SFT plateau mean (drift, points)",
                      "RL (vs plateau)", "continued SFT (vs plateau)", "SFT s", "RL s",
                      "cont. s", "total s"], rows)  # fmt: skip
    means = [100 * r["plateau_mean"] for r in results]
    gains = [100 * (r["rl_accuracy"] - r["plateau_mean"]) for r in results]
    notes = [
        f"- SFT plateau mean across variants: {min(means):.1f}-{max(means):.1f} % "
        f"(range {max(means) - min(means):.1f} points); RL gain over it {min(gains):+.1f} to "
        f"{max(gains):+.1f} points (target +15).",
        f"- {args.jobs} variant(s) at a time; load average {load_before:.1f} before, "
        f"{load_after:.1f} after (2 cores: above 2, the wall times are a busy machine's)."
        if not args.collect
        else "- Tabulated from runs made earlier (--collect); total s is "
        "the sum of the three phases.",
        "- Each row is one full `examples/demo.py` run; its curves are in "
        f"{out_root.relative_to(REPO)}/NAME/accuracy.png and reward.png.",
    ]
    publish("demo", "make demo under CPU kernel variants", "demo variants", [table], notes,
            quick=args.quick, started=started)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
