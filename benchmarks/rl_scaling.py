"""RL scaling: seconds per step as group size, batch size and response length grow; peak RSS.

One knob at a time from a base point (`--base G,B,L`: samples per prompt, prompts per step,
max response tokens), the sweep of the issue: group size 4/8/16, batch size 8/32/128 prompts,
response length 8/32/128 tokens. Every configuration runs in a fresh process with its own
local engine (so peak RSS belongs to that configuration): `run_rl_training` with the rl_tiny
set-up (sync mode, trainer and local engine `--threads` torch threads each, 1 as in rl_tiny,
GRPO, weights pushed every step) on the tiny model. Responses are forced to full length (`ignore_eos`), so the length knob is exact;
no group filter, so every step trains on B x G samples. Seconds per step is the median over
the steps after the first; the split generate / train / sync comes from the loop's own
metrics. Peak RSS: the trainer process's maximum resident set, and the engine's VmHWM.

Linearity: for each knob, the log-log slope of s/step between its smallest and largest value
(1 = linear in that knob, < 1 = fixed costs or batching amortise it, > 1 = superlinear).

    .venv/bin/python benchmarks/rl_scaling.py [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path

import plumbing.threads  # noqa: F401  (before torch: the project's OpenMP settings)

SWEEP = {"group": (4, 8, 16), "batch": (8, 32, 128), "length": (8, 32, 128)}


def run_config(group: int, batch: int, length: int, steps: int, threads: int) -> dict:
    """Child process: `steps` RL steps at this size; per-step times and peak memory."""
    import trio

    from engines import EnginePool, SGLangEngine, launch_engine
    from rollouts.config import RolloutConfig
    from rollouts.generation import single_turn_generate
    from rollouts.manager import AsyncRolloutManager
    from rollouts.prompts import load_prompt_jsonl
    from rollouts.tasks.arithmetic import digit_share_reward, write_arithmetic_datasets
    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.backend.tiny_model import build_tiny_model
    from training.config import OptimConfig
    from training.data.buffer import DataBuffer
    from training.loops.rl import run_rl_training
    from training.rl.algorithms import grpo
    from training.rl.batch import collate_rl
    from training.rl.objective import RLObjective
    from training.rl_config import RLLoopConfig

    tmp = Path(tempfile.mkdtemp(prefix="bench_scaling_"))
    model_dir = build_tiny_model(tmp / "model", seed=0)
    tok = load_tokenizer(model_dir)
    files = write_arithmetic_datasets(tmp / "data", n_sft=10, n_rl=batch * steps * 2, n_eval=10,
                                      min_digits=1, max_digits=2, ops="+")  # fmt: skip
    buffer = DataBuffer(load_prompt_jsonl(files.rl_train, tok), seed=0)
    backend = PyTorchTrainingBackend(
        lambda: load_model(model_dir), tok, optim=OptimConfig(lr=1e-5, schedule="constant"),
        max_steps=steps, checkpoint_dir=tmp / "ckpt", pack_length=None,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id), num_threads=threads,
    )  # fmt: skip
    rollout = RolloutConfig(batch_size=batch, n_samples_per_prompt=group, max_concurrency=128,
                            filter_groups="none", sampling={"max_new_tokens": length})  # fmt: skip
    loop = RLLoopConfig(max_steps=steps, eval_every=10**9, checkpoint_every=10**9,
                        log_every=10**9, resume="never")  # fmt: skip

    async def full_length(prompt, n, ctx):
        params = {**ctx.sampling_params, "ignore_eos": True}
        return await single_turn_generate(prompt, n, dataclasses.replace(ctx, sampling_params=params))  # fmt: skip

    async def main() -> tuple[list[dict], float]:
        extra = ["--num-threads", str(threads), "--max-running-requests", "128",
                 "--weight-version", "0"]  # fmt: skip
        async with (
            launch_engine(kind="local", model_path=model_dir, extra_args=extra) as launched,
            SGLangEngine(launched.url) as engine,
            EnginePool([engine]) as pool,
        ):
            manager = AsyncRolloutManager(
                pool, buffer, rollout, reward_fn=digit_share_reward, generate_fn=full_length,
                current_version=lambda: backend.weight_version, tokenizer=tok,
            )  # fmt: skip
            async with manager:
                history = await run_rl_training(backend, buffer, manager, [engine], loop,
                                                objective=RLObjective(grpo()),
                                                export_dir=tmp / "weights")  # fmt: skip
            return history, harness.peak_rss_mb(launched.pid)

    with backend:
        history, engine_rss = trio.run(main)
    keys = ("time_step_s", "time_generate_s", "time_train_s", "time_sync_s", "response_len_mean")
    return {"steps": [{k: m[k] for k in keys} for m in history], "engine_rss_mb": engine_rss,
            "trainer_rss_mb": harness.peak_rss_mb_self()}  # fmt: skip


def configs(base: tuple[int, int, int], sweep: dict) -> list[tuple[int, int, int]]:
    """The base point and every one-knob variation of it, without duplicates."""
    out = [base]
    for i, values in enumerate(sweep.values()):
        for v in values:
            c = list(base)
            c[i] = v
            if tuple(c) not in out:
                out.append(tuple(c))
    return out


def slope(points: list[tuple[float, float]]) -> float:
    (x0, y0), (x1, y1) = min(points), max(points)
    return math.log(y1 / y0) / math.log(x1 / x0)


def plot(results: dict, base: tuple[int, int, int], sweep: dict, quick: bool, threads: int
         ) -> Path | None:  # fmt: skip
    plt = harness.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    parts = (("gen", "generate", "tab:blue"), ("train", "train", "tab:green"),
             ("sync", "sync", "tab:gray"))  # fmt: skip
    for i, (ax, (knob, values)) in enumerate(zip(axes, sweep.items(), strict=True)):
        cfgs = [tuple(v if j == i else base[j] for j in range(3)) for v in values]
        cfgs = [c for c in cfgs if c in results]
        bottom = [0.0] * len(cfgs)
        for key, label, color in parts:
            heights = [results[c][key] for c in cfgs]
            ax.bar(range(len(cfgs)), heights, bottom=bottom, color=color, label=label)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_xticks(range(len(cfgs)), [str(c[i]) for c in cfgs])
        ax.set_xlabel({"group": "samples per prompt", "batch": "prompts per step",
                       "length": "response tokens"}[knob])  # fmt: skip
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{knob} (others: G={base[0]}, B={base[1]}, L={base[2]})", fontsize=9)
    axes[0].legend()
    fig.suptitle(f"RL step time on the tiny model (sync; trainer and local engine {threads} "
                 "threads each)")  # fmt: skip
    return harness.save_figure(fig, "rl_scaling", quick)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="8,8,32", help="G,B,L of the base point")
    p.add_argument("--steps", type=int, default=3, help="RL steps per configuration (1 untimed)")
    p.add_argument("--threads", type=int, default=1, help="torch threads, trainer and engine each")
    p.add_argument("--quick", action="store_true", help="smoke run: small sizes, 2 steps")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        g, b, length = map(int, args.one.split(","))
        harness.emit(run_config(g, b, length, args.steps, args.threads))
        return 0
    sweep = SWEEP
    if args.quick:
        harness.apply_quick(args, p, base="4,8,8", steps=2)
        sweep = {"group": (4, 8), "batch": (8, 16), "length": (8, 16)}
    base = tuple(map(int, args.base.split(",")))
    started = time.time()
    results = {}
    for cfg in configs(base, sweep):
        print(f"  G={cfg[0]} B={cfg[1]} L={cfg[2]} ...", flush=True)
        out = harness.run_child([__file__, "--one", ",".join(map(str, cfg)), f"--steps={args.steps}",
                                 f"--threads={args.threads}"])  # fmt: skip
        timed = out["steps"][1:] or out["steps"]
        results[cfg] = {
            "step": harness.median(s["time_step_s"] for s in timed),
            "gen": harness.median(s["time_generate_s"] for s in timed),
            "train": harness.median(s["time_train_s"] for s in timed),
            "sync": harness.median(s["time_sync_s"] for s in timed),
            "len": harness.median(s["response_len_mean"] for s in timed),
            "trainer_rss": out["trainer_rss_mb"], "engine_rss": out["engine_rss_mb"],
        }  # fmt: skip
    rows = []
    for (g, b, length), r in results.items():
        n = g * b
        rows.append([g, b, length, n, r["len"], r["step"], n / r["step"], r["gen"], r["train"],
                     r["sync"], r["trainer_rss"], r["engine_rss"]])  # fmt: skip
    table = harness.md_table(["G", "B", "L", "samples", "resp len", "s/step", "samples/s",
                              "generate s", "train s", "sync s", "trainer RSS MiB",
                              "engine RSS MiB"], rows)  # fmt: skip
    notes = []
    for i, (knob, values) in enumerate(sweep.items()):
        pts = [(v, results[tuple(v if j == i else base[j] for j in range(3))]["step"])
               for v in values]  # fmt: skip
        parts = {k: [results[tuple(v if j == i else base[j] for j in range(3))][k] for v in values]
                 for k in ("gen", "train", "sync")}  # fmt: skip
        share = {k: v[-1] / sum(p[-1] for p in parts.values()) for k, v in parts.items()}
        kind = "about linear" if 0.85 <= slope(pts) <= 1.15 else (
            "sublinear" if slope(pts) < 0.85 else "superlinear")  # fmt: skip
        notes.append(f"- {knob} {values[0]} -> {values[-1]} ({values[-1] / values[0]:.0f}x): "
                     f"s/step x{pts[-1][1] / pts[0][1]:.1f}, log-log slope {slope(pts):.2f} "
                     f"({kind}); at {values[-1]}: generate {share['gen']:.0%}, train "
                     f"{share['train']:.0%}, sync {share['sync']:.0%}")  # fmt: skip
    png = plot(results, base, sweep, args.quick, args.threads)
    head = (f"Base point G={base[0]} samples per prompt, B={base[1]} prompts, L={base[2]} "
            f"tokens; one knob varied at a time; {args.steps} steps per configuration, the "
            f"first untimed; responses forced to L tokens; trainer and engine {args.threads} "
            "torch threads each (sync mode).")  # fmt: skip
    harness.publish("rl_scaling", "RL step time and memory vs size", "RL scaling",
                    [head, table], notes, quick=args.quick, started=started,
                    image=harness.image_link(png, args.quick, "RL scaling"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
