"""The demo (`make demo`): SFT on an imperfect teacher until it plateaus, then RL against more SFT.

    python examples/demo.py [--out runs/demo] [--continued-steps MAX] [--sft KEY=VALUE ...]
        [--rl KEY=VALUE ...] [--start SFT_CHECKPOINT]

The task is 1-2 digit addition whose SFT demonstrations come from a teacher that drops the
units carry in 80 % of the sums that have one (configs/demo_sft.yaml): the kind of data a
weaker model or a hurried annotator writes. SFT learns the teacher, mistakes included, and is
trained until its held-out accuracy is flat. From that one checkpoint two arms run:
- RL (configs/demo_rl.yaml): DAPO rewarded by the true sum, which the teacher never gave;
- continued SFT: the same SFT data for the same wall time as RL took, at SFT's final rate.
More SFT can only imitate the teacher better; a verifiable reward can do better than it.

A stopped demo (Ctrl-C or SIGTERM: it says where it stopped and that `make demo` resumes it)
continues where it was when run again with the same arguments: each phase (OUT/sft, OUT/rl,
OUT/sft_continued) resumes from its own latest complete checkpoint, and a finished phase is
skipped with a line saying so (its numbers are kept in OUT/<phase>/demo_phase.json). Its wall
time counts the earlier run's time up to that checkpoint. `--fresh` deletes the three phases
first. `--start CKPT` skips SFT and runs both arms from an existing SFT checkpoint (its run's
metrics.jsonl gives the SFT curve), e.g. to compare arms again without retraining.
The last lines are a table (accuracy and wall time of each phase) and a verdict; OUT/summary.json
holds the same numbers, OUT/accuracy.png and OUT/reward.png the curves (with matplotlib).
`--sft`/`--rl` override config fields of the SFT phases and the RL phase (e.g. the kernel
variants: `--sft backend.num_threads=1 --sft optim.fused=true`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio
from demo_phases import Stage, StepClock, run_phase, stopped_message

from plumbing.errors import leaf_errors
from rollouts.errors import Interrupted, RolloutsError
from training.backend.checkpoint import checkpoint_step
from training.backend.futures import lr_lambda
from training.config import SFTRunConfig, load_config
from training.loops.loggers import setup_logging
from training.recipes.cli_run import run_stoppable
from training.recipes.plot import read_metrics
from training.recipes.rl import run_rl_recipe
from training.recipes.sft import run_sft_recipe
from training.rl_config import RLRunConfig

FLAT_EVALS = 5  # the plateau: the last this many SFT evals
FLAT_POINTS = 2.0  # ... whose least-squares line moves at most this many points across them
RL_TARGET_POINTS = 15.0  # what RL should add to the plateau's mean
# `make demo` on a quiet 2-core machine (benchmarks/RESULTS.md, section "demo", row native):
# seconds per step of SFT (338 s / 3000) and of RL (158 s / 200); continued SFT runs RL's time.
SFT_S_PER_STEP, RL_S_PER_STEP, MEASURED_CORES = 338 / 3000, 158 / 200, 2


def plan(sft_steps: int | None, rl_steps: int, *, load: float | None = None,
         cores: int | None = None) -> str:  # fmt: skip
    """What the demo is about to do and how long that took here before, scaled by the load now.

    CPU training shares the cores: at load L on C cores each phase runs at least L/C times
    slower, and SFT more (its threads wait on each other: at load 4-6 a whole demo took
    45 min 40 s, and at load 4.4 SFT steps took 1 s against 0.11 s quiet), so this is a floor;
    each step's line gives the time left at the pace actually measured.
    """
    sft_s = 0.0 if sft_steps is None else sft_steps * SFT_S_PER_STEP
    quiet_s = sft_s + 2 * rl_steps * RL_S_PER_STEP
    load = os.getloadavg()[0] if load is None else load
    cores = cores or os.cpu_count() or 1
    slow = max(1.0, load / cores) * MEASURED_CORES / min(cores, MEASURED_CORES)
    sft = ("skipped (--start)" if sft_steps is None else
           f"on an imperfect teacher, {sft_steps} steps (~{sft_s / 60:.0f} min)")  # fmt: skip
    return (
        f"demo: 1) SFT {sft}, 2) RL, {rl_steps} steps "
        f"(~{rl_steps * RL_S_PER_STEP / 60:.0f} min), 3) continued SFT for RL's wall time, then "
        f"a table and a verdict. On a quiet {MEASURED_CORES}-core machine that is "
        f"~{quiet_s / 60:.0f} min (benchmarks/RESULTS.md); SFT's time grows with the machine's "
        f"load, which is {load:.1f} on {cores} cores now: expect at least ~{quiet_s * slow / 60:.0f} "
        "min (45 min 40 s was measured at load 4-6). Every step prints a line with the time left."
    )


@dataclass(frozen=True)
class DemoResult:
    sft_checkpoint: str  # where both arms started
    sft_accuracy: float  # held-out greedy accuracy at the end of SFT (trainer's decode)
    sft_last_evals: tuple[float, ...]  # the last FLAT_EVALS evals of SFT
    sft_last_steps: tuple[int, ...]  # ... and their steps
    sft_wall_s: float | None  # None: SFT was not run here (--start)
    rl_before: float  # the same checkpoint measured through the engine
    rl_accuracy: float
    rl_steps: int
    rl_wall_s: float
    continued_accuracy: float
    continued_steps: int
    continued_wall_s: float
    rl_algorithm: str = "grpo"  # the RL phase's algorithm preset, for the table
    # seconds from each arm's start (as its wall time above counts) to each logged step
    rl_clock: tuple[tuple[int, float], ...] = ()
    continued_clock: tuple[tuple[int, float], ...] = ()

    @property
    def plateau_spread(self) -> float:
        """Points between the highest and lowest of the last evals (eval-to-eval jitter)."""
        return 100 * (max(self.sft_last_evals) - min(self.sft_last_evals))

    @property
    def plateau_mean(self) -> float:
        return sum(self.sft_last_evals) / len(self.sft_last_evals)

    @property
    def plateau_drift(self) -> float:
        """Points the least-squares line through the last evals climbs (or falls) across them.

        A curve still climbing toward a cliff drifts by many points; a plateau with eval-to-eval
        jitter (greedy answers flipping on a few held-out sums) drifts by ~0.
        """
        xs, ys = self.sft_last_steps, [100 * a for a in self.sft_last_evals]
        if len(xs) < 2:
            return float("nan")
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
        return slope * (xs[-1] - xs[0])

    def table(self) -> str:
        rows = [("SFT (imperfect teacher)", self.sft_accuracy, None, self.sft_wall_s),
                (f"+ RL ({self.rl_algorithm.upper()}, true-sum reward)", self.rl_accuracy, self.rl_steps, self.rl_wall_s),
                ("+ continued SFT (baseline)", self.continued_accuracy, self.continued_steps,
                 self.continued_wall_s)]  # fmt: skip
        lines = [f"{'phase':<30} {'held-out':>9} {'vs SFT':>8} {'steps':>6} {'wall':>8}"]
        for name, acc, steps, wall in rows:
            gain = "" if steps is None else f"{100 * (acc - self.sft_accuracy):+.1f}"
            wall_s = "n/a" if wall is None else f"{wall:.0f}s"
            lines.append(f"{name:<30} {acc:>9.1%} {gain:>8} {steps or '':>6} {wall_s:>8}")
        return "\n".join(lines)

    def verdict(self) -> str:
        flat = "flat" if abs(self.plateau_drift) <= FLAT_POINTS else "NOT flat"
        evals = " ".join(f"{a:.1%}" for a in self.sft_last_evals)
        gain = 100 * (self.rl_accuracy - self.plateau_mean)
        met = "met" if gain >= RL_TARGET_POINTS else "MISSED"
        lead = 100 * (self.rl_accuracy - self.continued_accuracy)
        beat = (f"RL beat continued SFT by {lead:.1f} points" if lead > 0 else
                f"RL did NOT beat continued SFT ({lead:+.1f} points)")  # fmt: skip
        time_note = ("" if self.continued_wall_s >= self.rl_wall_s else
                     f" (but continued SFT ran {self.continued_wall_s:.0f}s, less than RL's "
                     f"{self.rl_wall_s:.0f}s: raise --continued-steps)")  # fmt: skip
        steps = f"steps {self.sft_last_steps[0]}-{self.sft_last_steps[-1]}"
        return (f"SFT plateau: last {len(self.sft_last_evals)} evals ({steps}) {evals}: mean "
                f"{self.plateau_mean:.1%}, drift {self.plateau_drift:+.1f} points ({flat}), "
                f"spread {self.plateau_spread:.1f}\n"
                f"RL gain over the plateau mean: {gain:+.1f} points ({met}: target "
                f"+{RL_TARGET_POINTS:.0f})\n{beat}{time_note}")  # fmt: skip


def last_value(folder: Path, key: str) -> float | None:
    """The last logged `key` of a run's metrics.jsonl (a resumed finished run logs no step)."""
    values = [r[key] for r in read_metrics(folder) if key in r]
    return values[-1] if values else None


def arm_curve(rows: list[dict], key: str, clock: Sequence[tuple[int, float]],
              start: float) -> tuple[list[float], list[float]]:  # fmt: skip
    """(seconds, accuracy in %) of one arm: its start value at 0 s, then each eval at the
    second its step was logged (evaluation and set-up included, as in the table)."""
    at = dict(clock)
    xs, ys = [0.0], [100 * start]
    for r in rows:
        if key in r and r["step"] in at:
            xs.append(at[r["step"]])
            ys.append(100 * r[key])
    return xs, ys


def sft_evals(checkpoint: Path, rows: list[dict]) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of every eval up to `checkpoint` in its SFT run's `rows`."""
    step = checkpoint_step(checkpoint)
    return [(m["step"], m["accuracy"]) for m in rows if "accuracy" in m and m["step"] <= step]


async def run_demo(out: Path, continued_steps: int, sft_overrides: list[str],
                   rl_overrides: list[str], sft_config: str, rl_config: str,
                   start: Path | None = None, stage: Stage | None = None) -> DemoResult:  # fmt: skip
    stage = Stage() if stage is None else stage
    resume = "train.resume=auto"  # each phase continues from its own checkpoint, if any
    sft_cfg = load_config(SFTRunConfig, sft_config,
                          [*sft_overrides, f"output_dir={out / 'sft'}", resume])  # fmt: skip
    sft_wall = None
    if start is None:

        async def sft_phase(clock: StepClock) -> dict[str, Any]:
            sft = await run_sft_recipe(sft_cfg, on_step=clock)
            return {"checkpoint": str(sft.checkpoint), "wall_s": sft.wall_time_s,
                    "line": sft.line()}  # fmt: skip

        sft = await run_phase("SFT", sft_cfg, stage, sft_phase)
        start, sft_wall = Path(sft["checkpoint"]), sft["wall_s"]
    sft_rows = read_metrics(start.parent.parent)  # the SFT run's metrics.jsonl
    evals = sft_evals(start, sft_rows)[-FLAT_EVALS:]

    rl_cfg = load_config(RLRunConfig, rl_config, [*rl_overrides, f"output_dir={out / 'rl'}",
                                                  f"model.path={start}", resume])  # fmt: skip

    async def rl_phase(clock: StepClock) -> dict[str, Any]:
        rl = await run_rl_recipe(rl_cfg, on_step=clock)
        after = rl.accuracy_after
        if after is None:  # resumed at its last step: nothing run, the log has it
            after = last_value(out / "rl", "eval_accuracy")
        return {"accuracy_before": rl.accuracy_before, "accuracy": after, "steps": rl.steps,
                "wall_s": rl.wall_time_s, "line": rl.line()}  # fmt: skip

    rl = await run_phase("RL", rl_cfg, stage, rl_phase)

    # The baseline gets the same wall time as RL (train.max_wall_s), at the rate SFT's schedule
    # had reached at the checkpoint.
    final_lr = sft_cfg.optim.lr * lr_lambda(sft_cfg.optim, sft_cfg.train.max_steps)(
        checkpoint_step(start)
    )
    step_times = sorted(m["step_time_s"] for m in sft_rows if "step_time_s" in m)
    expected = rl["wall_s"] / step_times[len(step_times) // 2] if step_times else continued_steps
    every = max(1, int(min(expected, continued_steps)) // 5)
    cont_cfg = load_config(SFTRunConfig, sft_config, [
        *sft_overrides, f"output_dir={out / 'sft_continued'}", f"model.path={start}",
        f"train.max_steps={continued_steps}", f"train.max_wall_s={rl['wall_s']:.3f}",
        "optim.schedule=constant", "optim.warmup_steps=0", f"optim.lr={final_lr}",
        f"train.eval_every={every}", f"train.checkpoint_every={continued_steps}", resume,
    ])  # fmt: skip

    async def continued_phase(clock: StepClock) -> dict[str, Any]:
        cont = await run_sft_recipe(cont_cfg, on_step=clock)
        return {"accuracy": cont.accuracy, "steps": cont.steps, "wall_s": cont.wall_time_s,
                "line": cont.line()}  # fmt: skip

    cont = await run_phase("continued SFT", cont_cfg, stage, continued_phase)
    stage.name = "the table"
    return DemoResult(
        sft_checkpoint=str(start), sft_accuracy=evals[-1][1],
        sft_last_evals=tuple(a for _, a in evals), sft_last_steps=tuple(s for s, _ in evals),
        sft_wall_s=sft_wall, rl_before=rl["accuracy_before"], rl_accuracy=rl["accuracy"],
        rl_steps=rl["steps"], rl_wall_s=rl["wall_s"], continued_accuracy=cont["accuracy"],
        continued_steps=cont["steps"], continued_wall_s=cont["wall_s"],
        rl_algorithm=rl_cfg.algorithm.preset, rl_clock=tuple(map(tuple, rl["clock"])),
        continued_clock=tuple(map(tuple, cont["clock"])),
    )  # fmt: skip


def write_pngs(out: Path, result: DemoResult) -> list[Path]:
    """OUT/accuracy.png (SFT, then both arms against the wall time the table gives them) and
    OUT/reward.png (RL by step, from its start at step 0); every accuracy in %."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    start, algorithm = Path(result.sft_checkpoint), result.rl_algorithm.upper()
    rl, cont = (read_metrics(out / p) for p in ("rl", "sft_continued"))
    sft = sft_evals(start, read_metrics(start.parent.parent))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    a1.plot([s for s, _ in sft], [100 * a for _, a in sft], marker=".")
    a1.set(xlabel="SFT step", ylabel="held-out greedy accuracy (%)", title="SFT on the teacher")
    for (xs, ys), label in (
        (arm_curve(rl, "eval_accuracy", result.rl_clock, result.rl_before), f"RL ({algorithm})"),
        (arm_curve(cont, "accuracy", result.continued_clock, result.sft_accuracy),
         "continued SFT"),
    ):  # fmt: skip
        a2.plot(xs, ys, marker=".", label=label)
    a2.set(xlabel="seconds since the arm started (the table's wall time)",
           ylabel="held-out greedy accuracy (%)", title="From the same checkpoint")  # fmt: skip
    a2.legend()
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=100)
    plt.close(fig)
    # Every generated group's reward (a group filter's kept groups alone hover near 0.5).
    generated = all("reward_mean_generated" in r for r in rl)
    key = "reward_mean_generated" if generated else "reward_mean"
    evals = [(0, result.rl_before)] + [(r["step"], r["eval_accuracy"]) for r in rl
                                      if "eval_accuracy" in r]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([r["step"] for r in rl], [100 * r[key] for r in rl], lw=0.8,
            label="training samples")  # fmt: skip
    ax.plot([s for s, _ in evals], [100 * a for _, a in evals], marker=".",
            label="held-out greedy accuracy")  # fmt: skip
    ax.set(
        xlabel="RL step", ylabel="reward, accuracy (%)", title=f"{algorithm} reward", xlim=(0, None)
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=100)
    plt.close(fig)
    return [out / "accuracy.png", out / "reward.png"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo",
                        help="run directory (a stopped demo there is resumed)")  # fmt: skip
    parser.add_argument("--fresh", action="store_true",
                        help="delete the phases of an earlier demo in --out and start over")  # fmt: skip
    parser.add_argument("--sft-config", default="configs/demo_sft.yaml")
    parser.add_argument("--rl-config", default="configs/demo_rl.yaml")
    parser.add_argument("--continued-steps", type=int, default=100_000,
                        help="cap on continued-SFT steps; it runs for RL's wall time")  # fmt: skip
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE",
                        help="override for both SFT phases")  # fmt: skip
    parser.add_argument("--start", type=Path, default=None, metavar="SFT_CHECKPOINT",
                        help="skip SFT: run both arms from this SFT checkpoint")  # fmt: skip
    parser.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the RL phase")  # fmt: skip
    args = parser.parse_args()
    setup_logging()
    out, stage = Path(args.out), Stage()
    if args.fresh:
        for phase in ("sft", "rl", "sft_continued"):
            shutil.rmtree(out / phase, ignore_errors=True)
    try:
        sft_steps = load_config(SFTRunConfig, args.sft_config, args.sft).train.max_steps
        rl_steps = load_config(RLRunConfig, args.rl_config, args.rl).train.max_steps
        print(plan(None if args.start else sft_steps, rl_steps), flush=True)
        demo = partial(run_demo, out, args.continued_steps, args.sft, args.rl, args.sft_config,
                       args.rl_config, args.start, stage)  # fmt: skip
        result = trio.run(run_stoppable, demo)  # SIGINT or SIGTERM: stops cleanly, once
    except BaseException as err:  # a stop is a message, not a traceback
        leaves = leaf_errors(err)
        stops = [e for e in leaves if isinstance(e, Interrupted | KeyboardInterrupt)]
        if stops:  # a second signal arrives as KeyboardInterrupt, wherever the cleanup was
            name = stops[0].signal_name if isinstance(stops[0], Interrupted) else "SIGINT"
            print(stopped_message(name, stage, sys.argv[1:]), file=sys.stderr, flush=True)
            return 130
        if all(isinstance(e, RolloutsError) for e in leaves):
            for message in dict.fromkeys(str(e) for e in leaves):
                print(f"error: {message}", file=sys.stderr)
            return 2
        raise
    summary = {
        **asdict(result),
        "plateau_spread_points": result.plateau_spread,
        "plateau_mean": result.plateau_mean,
        "plateau_drift_points": result.plateau_drift,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    pngs = write_pngs(out, result)
    print(f"wrote {out / 'summary.json'}" + "".join(f", {p}" for p in pngs)
          + ("" if pngs else " (no PNGs: pip install matplotlib)"))  # fmt: skip
    print(result.table())
    print(result.verdict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
