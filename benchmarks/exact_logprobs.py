"""Exact logprobs (`engines.exact_logprobs`, issue 46): the engine/trainer mismatch of a GRPO run
with the mode on, over the whole matrix, and what the mode costs the engine.

1. The matrix: 20-step GRPO runs of the tiny recipe (configs/rl_tiny.yaml, 8 new tokens;
   --prompts x --samples per step, 16 x 8 as rl_tiny by default; random tiny model,
   digit-share reward, no group filter) with the mode on, at temperature 1 and 0.7, with the engine's prefix cache on and off, at one process
   and at two (FSDP2 under torchrun, gloo). Prints `logprob_diff_max_abs` of every step (the
   max |engine - trainer| logprob over the step's tokens) and the median step time. Two runs
   with the mode off (temperature 1, cache on, world 1 and 2) show the mismatch it removes.
2. The engine's cost: two local engine processes on the same model and thread count, one
   with `--exact-logprobs`, the same requests to both (alternating, medians of `--repeats`):
   an rl_tiny batch (16 prompts x 8 samples, 8 new tokens) and a longer one (64 new tokens).
   Prints output tokens/s of each and the ratio.

    .venv/bin/python benchmarks/exact_logprobs.py [--steps 20] [--repeats 3] [--quick]

Prints only: `--write-results` also writes its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import trio
from prefix_cache import rl_batch, rl_prompts
from transformers import AutoTokenizer

from engines import SGLangEngine, launch_engine
from training.backend.tiny_model import build_tiny_model

REPO = harness.REPO


def rl_run(model_dir: Path, out: Path, *, steps: int, world: int, temperature: float,
           prefix_cache: bool, exact: bool, prompts: int, samples: int) -> dict:  # fmt: skip
    """One GRPO run of the tiny recipe; its per-step mismatch and step times."""
    args = ["--config", str(REPO / "configs" / "rl_tiny.yaml"), "--model", str(model_dir),
            "--output-dir", str(out / "rl"), "--max-steps", str(steps),
            f"rollout.batch_size={prompts}", f"rollout.n_samples_per_prompt={samples}",
            "rollout.filter_groups=none", f"rollout.sampling.temperature={temperature}",
            "train.eval_samples=8", "train.eval_every=100000", f"train.checkpoint_every={steps}",
            "backend.num_threads=1", f"engines.exact_logprobs={str(exact).lower()}",
            f"engines.local_prefix_cache={str(prefix_cache).lower()}",
            "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
            f"data.task_dir={out / 'data'}", "data.arithmetic.n_rl=4000",
            "data.arithmetic.n_eval=16"]  # fmt: skip
    prefix = [sys.executable]
    if world > 1:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*prefix, str(REPO / "examples" / "run_rl.py"), *args], cwd=out,
                          env=env, capture_output=True, text=True, timeout=3600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    return {"diffs": [r["logprob_diff_max_abs"] for r in rows],
            "step_s": statistics.median(r["time_step_s"] for r in rows)}  # fmt: skip


def matrix(args: argparse.Namespace, model_dir: Path, tmp: Path) -> tuple[list[str], list[str]]:
    cells = [(world, t, cache, True) for world in (1, 2) for t in (1.0, 0.7)
             for cache in (True, False)]  # fmt: skip
    cells += [(1, 1.0, True, False), (2, 1.0, True, False)]  # the mode off: the mismatch
    rows, per_step, all_zero = [], [], True
    for k, (world, t, cache, exact) in enumerate(cells):
        result = rl_run(model_dir, tmp / f"run{k}", steps=args.steps, world=world,
                        temperature=t, prefix_cache=cache, exact=exact, prompts=args.prompts,
                        samples=args.samples)  # fmt: skip
        diffs = result["diffs"]
        if exact:
            all_zero &= all(d == 0.0 for d in diffs) and len(diffs) == args.steps
        label = (f"world {world}, T={t}, prefix cache {'on' if cache else 'off'}, "
                 f"exact {'on' if exact else 'off'}")  # fmt: skip
        rows.append([label, len(diffs), f"{max(diffs):.3g}", result["step_s"]])
        per_step.append(f"- {label}: " + " ".join(f"{d:.3g}" for d in diffs))
        print(per_step[-1], flush=True)
    head = (f"GRPO on the tiny recipe ({args.prompts} prompts x {args.samples} samples, "
            f"{args.steps} steps; logprob_diff_max_abs of every step):")  # fmt: skip
    table = harness.md_table(["run", "steps", "max over steps", "median step s"], rows)
    verdict = ("every step of every exact run: 0.0" if all_zero
               else "NOT all zero: see the per-step lines")  # fmt: skip
    return [head, table, "Per step:\n\n" + "\n".join(per_step)], [f"Exact mode: {verdict}."]


async def engine_cost(args: argparse.Namespace, model_dir: Path) -> tuple[list[str], list[str]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = ["--num-threads", str(args.threads), "--max-running-requests", "128"]
    sides = {"off": base, "on (--exact-logprobs)": [*base, "--exact-logprobs"]}
    workloads = {"rl_tiny batch": args.new_tokens, "longer responses": args.long_tokens}
    tps: dict[tuple[str, str], list[float]] = {(s, w): [] for s in sides for w in workloads}
    async with (
        launch_engine(kind="local", model_path=model_dir, extra_args=sides["off"]) as off,
        launch_engine(
            kind="local", model_path=model_dir, extra_args=sides["on (--exact-logprobs)"]
        ) as on,  # fmt: skip
        SGLangEngine(off.url) as engine_off,
        SGLangEngine(on.url) as engine_on,
    ):
        engines = dict(zip(sides, (engine_off, engine_on), strict=True))
        for e in engines.values():  # warm up
            await rl_batch(e, rl_prompts(tokenizer, 2, seed=99), 2, 2)
        for repeat in range(args.repeats):
            # the same requests to both sides
            prompts = rl_prompts(tokenizer, args.engine_prompts, seed=repeat)
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for workload, new in workloads.items():
                for side in order:
                    rate, _ = await rl_batch(engines[side], prompts, args.engine_samples, new)
                    tps[side, workload].append(rate)
    rows, notes = [], []
    for workload, new in workloads.items():
        med = {s: statistics.median(tps[s, workload]) for s in sides}
        for side in sides:
            rows.append([f"{workload} ({args.engine_prompts} x {args.engine_samples}, {new} new tokens)", side,
                         med[side]])  # fmt: skip
        off_tps, on_tps = med["off"], med["on (--exact-logprobs)"]
        notes.append(f"{workload}: exact mode gives {on_tps / off_tps:.2f}x the tokens/s of "
                     f"the fast logprobs ({on_tps:.0f} vs {off_tps:.0f}).")  # fmt: skip
    head = (f"Local engine, exact logprobs off vs on (tiny model, torch threads {args.threads}, "
            f"median of {args.repeats} alternating repeats):")  # fmt: skip
    return [head, harness.md_table(["workload", "exact logprobs", "output tokens/s"], rows)], notes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: build)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--engine-prompts", type=int, default=16)
    parser.add_argument("--engine-samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-matrix", action="store_true", help="only the engine's cost")
    parser.add_argument("--write-results", action="store_true",
                        help="also write this section of benchmarks/RESULTS.md")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        harness.apply_quick(
            args,
            parser,
            steps=2,
            prompts=4,
            samples=2,
            engine_prompts=4,
            engine_samples=2,
            repeats=1,
        )
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "model", seed=0)
        parts, notes = trio.run(engine_cost, args, model_dir)
        print("\n".join(parts + notes), flush=True)
        if not args.skip_matrix:
            more, more_notes = matrix(args, model_dir, Path(tmp))
            parts, notes = more + parts, more_notes + notes
    body = "\n\n".join(parts) + "\n\n" + "\n".join(notes)
    print("\n" + body)
    if args.write_results:
        harness.write_section("exact_logprobs", "Exact logprobs: mismatch and engine cost "
                              "(issue 46)", body, quick=args.quick, started=started)  # fmt: skip


if __name__ == "__main__":
    main()
