"""Reward curves on the tiny arithmetic task when the engine's logprobs are wrong, side by side.

The engine's logprobs reach the trainer perturbed by a deterministic, known amount (a transform
on each scored sample, `perturb`): ±0.3 nats on most tokens and +2 on one in ten (the engine
claims a token far likelier than the trainer finds it: a ratio π_train / π_engine of e^-2).
In `rollout.mode=overlap` the engine's logprobs are PPO's old policy unless a mismatch
correction is set (training/rl/mismatch.py, docs/rl.md "When the engine and trainer disagree"),
so the uncorrected arm trains with a wrong ratio and clip; the corrected arms take the ratio to
the trainer's logprobs and weight each token by the correction. Arms (same SFT checkpoint, same
prompt order, `configs/rl_tiny.yaml`):

    exact        overlap, the engine's logprobs as they are, no correction
    perturbed    overlap, perturbed, no correction
    tis          overlap, perturbed, mismatch=tis (hi 2)
    icepop       overlap, perturbed, mismatch=icepop ([0.5, 5])

Prints the mean training reward per block of steps for each arm, the held-out accuracy before
and after, and each arm's mean mismatch statistics. It writes nothing to RESULTS.md.

    .venv/bin/python benchmarks/mismatch_correction.py [--steps 100] [--every 10]
        [--arms exact,perturbed,tis,icepop] [--out runs/bench_mismatch] [OVERRIDE ...]

OVERRIDE: dotted config overrides for every arm (e.g. train.eval_samples=100).

The first run trains the SFT checkpoint the RL recipe starts from (configs/sft_tiny.yaml).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

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


def offset(token: int, position: int) -> float:
    """The engine's logprob error on a token: +2 on one token in ten, else ±0.3."""
    h = (31 * token + 17 * position) % 10
    return 2.0 if h == 0 else (0.3 if h % 2 else -0.3)


def perturb(sample: Sample) -> Sample:
    """`sample` with its engine logprobs offset by `offset` (a deterministic perturbation)."""
    if not sample.rollout_logprobs:
        return sample
    wrong = tuple(lp + offset(tok, k) for k, (tok, lp) in
                  enumerate(zip(sample.response_ids, sample.rollout_logprobs, strict=True)))  # fmt: skip
    return replace(sample, rollout_logprobs=wrong)


async def run_arm(arm: str, steps: int, out: Path, extra: list[str]) -> dict:
    overrides, perturbed = ARMS[arm]
    config = load_config(RLRunConfig, REPO / "configs/rl_tiny.yaml", [
        f"output_dir={out / arm}", f"train.max_steps={steps}", "rollout.mode=overlap",
        f"train.eval_every={steps}", f"train.checkpoint_every={steps}", *overrides, *extra,
    ])  # fmt: skip
    extensions = RLExtensions(transforms=(perturb,) if perturbed else ())
    summary = await run_rl_recipe(config, extensions=extensions, config_dir=REPO / "configs")
    rows = [json.loads(line) for line in (out / arm / "metrics.jsonl").read_text().splitlines()]
    stats = {k: statistics.fmean(r[k] for r in rows if k in r) for k in STATS
             if any(k in r for r in rows)}  # fmt: skip
    return {"curve": summary.reward_curve, "before": summary.accuracy_before,
            "after": summary.accuracy_after, "stats": stats}  # fmt: skip


def print_tables(results: dict[str, dict], every: int) -> None:
    arms = list(results)
    print(f"\nmean training reward per {every} steps")
    print("| steps | " + " | ".join(arms) + " |")
    print("|---|" + "---:|" * len(arms))
    n = max(len(r["curve"]) for r in results.values())
    for start in range(0, n, every):
        cells = []
        for arm in arms:
            block = results[arm]["curve"][start : start + every]
            cells.append(f"{statistics.fmean(block):.3f}" if block else "")
        print(f"| {start + 1}-{min(start + every, n)} | " + " | ".join(cells) + " |")

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    print("\n| arm | held-out before | after | " + " | ".join(STATS) + " |")
    print("|---|---:|---:|" + "---:|" * len(STATS))
    for arm, r in results.items():
        stats = " | ".join(f"{r['stats'][k]:.4f}" if k in r["stats"] else "" for k in STATS)
        print(f"| {arm} | {pct(r['before'])} | {pct(r['after'])} | {stats} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, default=REPO / "runs/bench_mismatch")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every arm")
    args = parser.parse_args()
    results = {}
    for arm in args.arms.split(","):
        if arm not in ARMS:
            raise SystemExit(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        results[arm] = trio.run(run_arm, arm, args.steps, args.out, args.overrides)
        print(f"{arm}: done", flush=True)
    print_tables(results, args.every)


if __name__ == "__main__":
    main()
