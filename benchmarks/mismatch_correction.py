"""Learning curves on the demo's task when the engine's logprobs are wrong, side by side (issue 46).

The engine's logprobs reach the trainer perturbed by a deterministic, known amount (a transform
on each scored sample, `perturb`): ±`--small` nats on most tokens and +`--big` on one in ten (the
engine claims a token far likelier than the trainer finds it: a ratio π_train / π_engine of
e^-big). In `rollout.mode=overlap` the engine's logprobs are PPO's old policy unless a mismatch
correction is set (training/rl/mismatch.py, docs/rl.md "When the engine and trainer disagree"),
so the uncorrected arm trains with a wrong ratio and clip; the corrected arms take the ratio to
the trainer's logprobs and weight each token by the correction. Arms (same start, same prompt
order, the demo's RL recipe `configs/demo_rl.yaml` in overlap mode):

    exact        the engine's logprobs as they are, no correction
    perturbed    perturbed, no correction
    tis          perturbed, mismatch=tis (hi 2)
    icepop       perturbed, mismatch=icepop ([0.5, 5])

The start is the demo's SFT checkpoint (`make demo`, runs/demo/sft; or `--start`). Each arm's
held-out greedy accuracy is measured every `--eval-every` steps (the recipe's evaluation through
the engine). Prints the held-out curve and the mean training reward per block of steps for each
arm, and each arm's mean mismatch statistics; `--png` draws the held-out curves and
`--write-results` puts the tables in benchmarks/RESULTS.md (section `mismatch_correction`).

    .venv/bin/python benchmarks/mismatch_correction.py [--start MODEL_DIR] [--steps 100]
        [--eval-every 10] [--arms exact,perturbed,tis,icepop] [--out runs/bench_mismatch]
        [--png docs/mismatch_correction.png] [--write-results] [OVERRIDE ...]

OVERRIDE: dotted config overrides for every arm (e.g. train.eval_samples=200).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rollouts.types import Sample  # noqa: E402
from training.config import load_config  # noqa: E402
from training.recipes.rl import RLExtensions, run_rl_recipe  # noqa: E402
from training.rl_config import RLRunConfig  # noqa: E402

ARMS = {
    "exact": ([], False),
    "perturbed": ([], True),
    "tis": (["algorithm.overrides.mismatch=tis"], True),
    "icepop": (["algorithm.overrides.mismatch=icepop"], True),
}
STATS = ("mismatch_outside_fraction", "mismatch_kl_k3", "clip_fraction", "tis_capped_fraction",
         "icepop_masked_fraction")  # fmt: skip


SMALL, BIG = 0.3, 2.0  # nats; set from --small / --big


def offset(token: int, position: int) -> float:
    """The engine's logprob error on a token: +BIG on one token in ten, else ±SMALL."""
    h = (31 * token + 17 * position) % 10
    return BIG if h == 0 else (SMALL if h % 2 else -SMALL)


def perturb(sample: Sample) -> Sample:
    """`sample` with its engine logprobs offset by `offset` (a deterministic perturbation)."""
    if not sample.rollout_logprobs:
        return sample
    wrong = tuple(lp + offset(tok, k) for k, (tok, lp) in
                  enumerate(zip(sample.response_ids, sample.rollout_logprobs, strict=True)))  # fmt: skip
    return replace(sample, rollout_logprobs=wrong)


def demo_start() -> Path | None:
    """The demo's SFT checkpoint (runs/demo/sft), as a loadable model directory."""
    from training.backend.checkpoint import find_latest_checkpoint
    from training.backend.lora import loadable_model_dir

    latest = find_latest_checkpoint(REPO / "runs/demo/sft/checkpoints")
    return None if latest is None else Path(loadable_model_dir(latest))


async def run_arm(arm: str, args: argparse.Namespace) -> dict:
    overrides, perturbed = ARMS[arm]
    out = args.out / arm
    config = load_config(RLRunConfig, args.config, [
        f"output_dir={out}", f"model.path={args.start}", f"train.max_steps={args.steps}",
        "rollout.mode=overlap", f"train.eval_every={args.eval_every}",
        f"train.eval_samples={args.eval_samples}", f"train.checkpoint_every={args.steps}",
        "train.resume=never", *overrides, *args.overrides,
    ])  # fmt: skip
    extensions = RLExtensions(transforms=(perturb,) if perturbed else ())
    summary = await run_rl_recipe(config, extensions=extensions, config_dir=REPO / "configs")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stats = {k: statistics.fmean(r[k] for r in rows if k in r) for k in STATS
             if any(k in r for r in rows)}  # fmt: skip
    heldout = [(0, summary.accuracy_before)] + [(r["step"], r["eval_accuracy"]) for r in rows
                                                if "eval_accuracy" in r]  # fmt: skip
    return {"curve": list(summary.reward_curve), "heldout": heldout,
            "before": summary.accuracy_before, "after": summary.accuracy_after,
            "stats": stats}  # fmt: skip


def tables(results: dict[str, dict], every: int) -> list[str]:
    arms = list(results)

    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:.1f}%"

    steps = sorted({s for r in results.values() for s, _ in r["heldout"]})
    held = ["| step | " + " | ".join(arms) + " |", "|---|" + "---:|" * len(arms)]
    for s in steps:
        held.append(f"| {s} | " + " | ".join(pct(dict(results[a]["heldout"]).get(s))
                                            for a in arms) + " |")  # fmt: skip
    reward = ["| steps | " + " | ".join(arms) + " |", "|---|" + "---:|" * len(arms)]
    n = max(len(r["curve"]) for r in results.values())
    for start in range(0, n, every):
        cells = []
        for arm in arms:
            block = results[arm]["curve"][start : start + every]
            cells.append(f"{statistics.fmean(block):.3f}" if block else "")
        reward.append(f"| {start + 1}-{min(start + every, n)} | " + " | ".join(cells) + " |")
    stats = ["| arm | held-out before | after | best | " + " | ".join(STATS) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(STATS)]  # fmt: skip
    for arm, r in results.items():
        cells = " | ".join(f"{r['stats'][k]:.4f}" if k in r["stats"] else "" for k in STATS)
        best = max(a for _, a in r["heldout"] if a is not None)
        stats.append(f"| {arm} | {pct(r['before'])} | {pct(r['after'])} | {pct(best)} | "
                     f"{cells} |")  # fmt: skip
    return ["Held-out greedy accuracy (the demo's 500 held-out sums unless overridden):",
            "\n".join(held), f"Mean training reward per {every} steps:", "\n".join(reward),
            "Per arm, means over the run:", "\n".join(stats)]  # fmt: skip


def write_png(path: Path, results: dict[str, dict]) -> Path | None:
    curves = {arm: [(s, 100 * a) for s, a in r["heldout"] if a is not None]
              for arm, r in results.items()}  # fmt: skip
    return harness.curves_png(
        path,
        curves,
        xlabel="RL step (overlap mode)",
        ylabel="held-out greedy accuracy (%)",
        title=f"Engine logprobs off by ±{SMALL:g} / +{BIG:g} nats: with and without a correction",
    )


def main() -> None:
    global SMALL, BIG
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs/demo_rl.yaml")
    parser.add_argument(
        "--start",
        type=Path,
        default=None,
        help="model directory the arms start from (default: the demo's SFT)",
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="steps per training-reward block")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("--small", type=float, default=SMALL, help="nats on most tokens (±)")
    parser.add_argument("--big", type=float, default=BIG, help="nats on one token in ten (+)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, default=REPO / "runs/bench_mismatch")
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every arm")
    args = parser.parse_args()
    SMALL, BIG = args.small, args.big
    started = time.time()
    if args.start is None:
        args.start = demo_start()
        if args.start is None:
            raise SystemExit("no runs/demo/sft checkpoint: run `make demo` (or its SFT stage), "
                             "or pass --start MODEL_DIR")  # fmt: skip
    results = {}
    for arm in args.arms.split(","):
        if arm not in ARMS:
            raise SystemExit(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        results[arm] = trio.run(run_arm, arm, args)
        print(f"{arm}: done", flush=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    head = (f"Start: {args.start} (held-out {results[next(iter(results))]['before']:.1%}); "
            f"{args.steps} steps of {args.config.name} in overlap mode per arm; engine "
            f"logprobs off by ±{SMALL:g} nats on most tokens and +{BIG:g} on one in ten "
            "(all arms but `exact`).")  # fmt: skip
    parts = [head, *tables(results, args.every)]
    if args.write_results:
        png = write_png(args.png or harness.results_dir(False) / "mismatch_correction.png",
                        results)  # fmt: skip
        harness.publish("mismatch_correction", "Mismatch corrections under perturbed engine "
                        "logprobs (issue 46)", "Mismatch correction", parts, [],
                        quick=False, started=started,
                        image=harness.image_link(png and png.resolve(), False,
                                                 "held-out curves"))  # fmt: skip
    else:
        if args.png:
            write_png(args.png, results)
        print("\n\n".join(parts))


if __name__ == "__main__":
    main()
