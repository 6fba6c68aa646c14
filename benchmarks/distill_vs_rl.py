"""On-policy distillation vs RL from the same start, on the demo's task (issue 46 item 2).

    .venv/bin/python benchmarks/distill_vs_rl.py [--demo runs/demo] [--steps 40] [--eval-every 5]

1. The start and the teacher: the demo's SFT checkpoint (`make demo`, OUT/sft) and the demo's
   RL-trained checkpoint (OUT/rl), reused when present. Missing ones are made with the demo's
   own stages and configs (configs/demo_sft.yaml, configs/demo_rl.yaml: DAPO rewarded by the
   true sum), `--sft-steps` / `--teacher-steps` bounding them on a busy machine.
2. Two arms from the start, each for `--steps` steps with the same sampling budget (16 prompts x
   8 samples a step, temperature 1, 8 new tokens: demo_rl.yaml's rollout section):
   - distill: `algorithm.preset: distill`, `teacher.model: <the teacher>` (a local engine is
     launched on it), the task reward only logged;
   - RL: the demo's RL recipe (DAPO, true-sum reward). When the teacher is made here its run is
     this arm (the same recipe from the same start), evaluated as often as the distill arm.
   Held-out greedy accuracy is measured the same way for both (the recipe's evaluation
   through the engine, `--eval-samples` prompts of the demo's held-out split, every
   `--eval-every` steps). DAPO over-samples to fill its batch with groups whose samples
   disagree; `groups generated` counts what each arm sampled.
3. Prints a table (accuracy at each eval; the step each arm first reaches 80 % of the teacher's
   gain over the start) and writes docs/distill_vs_rl.png and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import trio

import plumbing.threads  # noqa: F401  (before torch: the project's OpenMP settings)
from training.backend.checkpoint import find_latest_checkpoint
from training.backend.lora import loadable_model_dir
from training.config import SFTRunConfig, load_config
from training.loops.loggers import setup_logging
from training.recipes.plot import read_metrics
from training.recipes.rl import run_rl_recipe
from training.recipes.sft import run_sft_recipe
from training.rl_config import RLRunConfig

REPO = Path(__file__).resolve().parent.parent
SFT_CONFIG, RL_CONFIG = REPO / "configs" / "demo_sft.yaml", REPO / "configs" / "demo_rl.yaml"
SHARE = 0.8  # of the teacher's gain over the start


def latest_model(run_dir: Path) -> Path | None:
    latest = find_latest_checkpoint(run_dir / "checkpoints")
    return None if latest is None else Path(loadable_model_dir(latest))


def eval_overrides(args: argparse.Namespace) -> list[str]:
    return [f"train.eval_every={args.eval_every}", f"train.eval_samples={args.eval_samples}",
            "train.checkpoint_every=100000", "train.resume=never"]  # fmt: skip


async def get_start(args: argparse.Namespace) -> Path:
    """The demo's SFT checkpoint, or one made with the demo's SFT stage."""
    if args.start is not None:
        return args.start
    found = latest_model(args.demo / "sft")
    if found is not None:
        print(f"start: the demo's SFT checkpoint {found}", flush=True)
        return found
    overrides = [f"output_dir={args.demo / 'sft'}", "train.resume=auto"]
    if args.sft_steps:
        overrides.append(f"train.max_steps={args.sft_steps}")
    sft = await run_sft_recipe(load_config(SFTRunConfig, SFT_CONFIG, overrides))
    print(sft.line(), flush=True)
    return Path(loadable_model_dir(sft.checkpoint))


async def run_arm(name: str, out: Path, start: Path, steps: int, extra: list[str],
                  args: argparse.Namespace) -> Path:  # fmt: skip
    """Run one arm; OUT/arm.json keeps its held-out accuracy before the first step."""
    overrides = [f"output_dir={out}", f"model.path={start}", f"train.max_steps={steps}",
                 *eval_overrides(args), *extra, *args.rl]  # fmt: skip
    summary = await run_rl_recipe(load_config(RLRunConfig, RL_CONFIG, overrides))
    print(f"{name}: {summary.line()}", flush=True)
    (out / "arm.json").write_text(json.dumps({"accuracy_before": summary.accuracy_before}))
    return out


async def get_teacher_and_rl_arm(args: argparse.Namespace, start: Path) -> tuple[Path, Path]:
    """(teacher model dir, RL arm's run dir)."""
    if args.rl_arm is not None:  # an earlier RL arm (the teacher's own run when it is demo/rl)
        teacher = args.teacher or latest_model(args.demo / "rl")
        print(f"teacher: {teacher}; RL arm: {args.rl_arm} (not run again)", flush=True)
        return Path(teacher), args.rl_arm
    if args.teacher is not None or latest_model(args.demo / "rl") is not None:
        teacher = args.teacher or latest_model(args.demo / "rl")
        print(f"teacher: {teacher}", flush=True)
        rl = await run_arm("RL", args.out / "rl", start, args.steps, [], args)
        return Path(teacher), rl
    steps = args.teacher_steps or load_config(RLRunConfig, RL_CONFIG).train.max_steps
    print(
        f"teacher: none in {args.demo / 'rl'}; the demo's RL stage for {steps} steps, "
        "from the start, is the teacher and the RL arm",
        flush=True,
    )
    rl = await run_arm("RL (= teacher)", args.demo / "rl", start, steps,
                       ["train.checkpoint_every=" + str(steps)], args)  # fmt: skip
    return Path(latest_model(rl)), rl  # type: ignore[arg-type]


def curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of a run, its start (before RL) at step 0."""
    before = json.loads((run_dir / "arm.json").read_text())["accuracy_before"]
    rows = read_metrics(run_dir)
    return [(0, before)] + [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]


def first_reaching(points: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, a in points if s > 0 and a >= target), None)


def cumulative_groups(run_dir: Path) -> dict[int, float]:
    """Groups generated (sampled, kept or not) from the start to each step of a run."""
    total, out = 0.0, {}
    for r in read_metrics(run_dir):
        if "groups_launched" in r:
            total += r["groups_launched"]
            out[r["step"]] = total
    return out


def table(arms: dict[str, list[tuple[int, float]]], start: float, teacher: float,
          groups: dict[str, dict[int, float]]) -> str:  # fmt: skip
    target = start + SHARE * (teacher - start)
    steps = sorted({s for pts in arms.values() for s, _ in pts})
    lines = [f"start {start:.1%}, teacher {teacher:.1%} (gain {100 * (teacher - start):+.1f} "
             f"points); {SHARE:.0%} of the gain = {target:.1%}", "",
             "| arm | steps to 80 % of the teacher's gain | groups generated by then | best "
             "| groups generated per step |", "|---|---|---|---|---|"]  # fmt: skip
    for name, pts in arms.items():
        reached = first_reaching(pts, target)
        by_then = "" if reached is None else f"{groups[name].get(reached, float('nan')):.0f}"
        per_step = max(groups[name].values()) / max(groups[name]) if groups[name] else 0.0
        lines.append(f"| {name} | {reached if reached is not None else 'not reached'} | "
                     f"{by_then} | {max(a for _, a in pts):.1%} | {per_step:.1f} |")  # fmt: skip
    lines += ["", "| step | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for s in steps:
        row = [dict(pts).get(s) for pts in arms.values()]
        lines.append(f"| {s} | " + " | ".join("" if a is None else f"{a:.1%}" for a in row) + " |")
    return "\n".join(lines)


def write_png(path: Path, arms: dict[str, list[tuple[int, float]]], start: float,
              teacher: float) -> Path | None:  # fmt: skip
    target = start + SHARE * (teacher - start)
    return harness.curves_png(
        path, {name: [(s, 100 * a) for s, a in pts] for name, pts in arms.items()},
        xlabel="training step (16 prompts x 8 samples trained on in each)",
        ylabel="held-out greedy accuracy (%)",
        title="On-policy distillation vs RL from the same start",
        hlines=[(100 * teacher, "--", "teacher"),
                (100 * target, ":", "80 % of the teacher's gain")])  # fmt: skip


def report_arms(args: argparse.Namespace) -> int:
    """--arm NAME=RUN_DIR ...: the table and the PNG of earlier runs' arms, side by side."""
    arms = {}
    for spec in args.arm:
        name, _, run_dir = spec.partition("=")
        arms[name] = curve(Path(run_dir))
    teacher_run = args.demo / "rl"
    teacher_acc = args.teacher_accuracy
    if teacher_acc is None:
        evals = [r["eval_accuracy"] for r in read_metrics(teacher_run) if "eval_accuracy" in r]
        if not evals:
            raise SystemExit(f"no held-out eval in {teacher_run}: pass --teacher-accuracy")
        teacher_acc = evals[-1]
    start_acc = next(iter(arms.values()))[0][1]
    groups = {name: cumulative_groups(Path(spec.partition("=")[2]))
              for name, spec in zip(arms, args.arm, strict=True)}  # fmt: skip
    text = table(arms, start_acc, teacher_acc, groups)
    print(text)
    png = write_png(args.png, arms, start_acc, teacher_acc)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"start_accuracy": start_acc, "teacher_accuracy": teacher_acc, "arms": arms,
               "runs": dict(zip(arms, args.arm, strict=True)), "table": text}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'summary.json'}" + (f", {png}" if png else " (no matplotlib)"))
    return 0


async def main_async(args: argparse.Namespace) -> int:
    if args.arm:
        return report_arms(args)
    if args.report_only:  # the arms of an earlier run in --out (and the teacher's in --demo)
        start, teacher = args.start, args.teacher or latest_model(args.demo / "rl")
        distill_dir = args.out / "distill"
        rl_dir = args.out / "rl" if (args.out / "rl").is_dir() else args.demo / "rl"
    else:
        start = await get_start(args)
        teacher, rl_dir = await get_teacher_and_rl_arm(args, start)
        distill_dir = await run_arm(
            "distill", args.out / "distill", start, args.steps,
            ["algorithm.preset=distill", f"teacher.model={teacher}", *args.distill], args)  # fmt: skip
    arms = {"distill": curve(distill_dir), "RL (DAPO)": curve(rl_dir)}
    start_acc = arms["distill"][0][1]  # the same checkpoint and held-out prompts for both
    teacher_acc = args.teacher_accuracy
    if teacher_acc is None and rl_dir == args.demo / "rl":  # the teacher's own run is the RL arm
        teacher_acc = arms["RL (DAPO)"][-1][1]
    elif teacher_acc is None:  # the teacher's run: its last held-out eval
        evals = [r["eval_accuracy"] for r in read_metrics(teacher.parent.parent)
                 if "eval_accuracy" in r]  # fmt: skip
        if not evals:
            raise SystemExit(f"no held-out eval in the run of {teacher}: pass --teacher-accuracy")
        teacher_acc = evals[-1]
    groups = {"distill": cumulative_groups(distill_dir), "RL (DAPO)": cumulative_groups(rl_dir)}
    text = table(arms, start_acc, teacher_acc, groups)
    print(text)
    png = write_png(args.png, arms, start_acc, teacher_acc)
    summary = {"start": str(start), "teacher": str(teacher), "start_accuracy": start_acc,
               "teacher_accuracy": teacher_acc, "arms": arms, "groups_generated": groups,
               "table": text}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'summary.json'}" + (f", {png}" if png else " (no matplotlib)"))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=Path("runs/demo"),
                        help="the demo's output directory (its sft/ and rl/ are reused)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("runs/distill_vs_rl"))
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "distill_vs_rl.png")
    parser.add_argument("--steps", type=int, default=40, help="steps of each arm")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("--start", type=Path, default=None, help="the start model directory")
    parser.add_argument("--teacher", type=Path, default=None, help="the teacher model directory")
    parser.add_argument("--teacher-accuracy", type=float, default=None)
    parser.add_argument("--sft-steps", type=int, default=None,
                        help="making the start: SFT steps (default: the demo's 3000)")  # fmt: skip
    parser.add_argument("--teacher-steps", type=int, default=None,
                        help="making the teacher: RL steps (default: the demo's 200)")  # fmt: skip
    parser.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE",
                        help="override for both arms (e.g. engines.local_threads=2)")  # fmt: skip
    parser.add_argument("--report-only", action="store_true",
                        help="no runs: the table and PNG of the arms already in --out")  # fmt: skip
    parser.add_argument("--rl-arm", type=Path, default=None,
                        help="an earlier run's RL arm to compare with (e.g. DEMO/rl, the "
                        "teacher's own run), not run again")  # fmt: skip
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=RUN_DIR",
                        help="report only: earlier runs' arms side by side (the first one's "
                        "start is the start; the teacher's accuracy from DEMO/rl's last eval)")  # fmt: skip
    parser.add_argument("--distill", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the distill arm only")  # fmt: skip
    args = parser.parse_args()
    setup_logging()
    return trio.run(main_async, args)


if __name__ == "__main__":
    sys.exit(main())
