"""FSDP2 overhead on CPU: 2 processes × 1 thread (torchrun, gloo) vs 1 process × 2 threads.

Both arms use the machine's two cores for the same work: the same `small` model (~25 M
params), the same SFT steps (32 chat samples per step, packed rows of 256) and the same GRPO
updates (8 groups × 8 responses of 24-64 tokens, prefix-shared rows), through
`PyTorchTrainingBackend` — in one process, or sharded with `fully_shard` across two ranks
driven from rank 0. On CPU sharding cannot be faster (the two cores are there either way):
the ratio is the cost of the collectives and the command channel (target ≥ 0.8×). Peak RSS
per rank shows what sharding saves (parameters, gradients and AdamW state are split in two;
torch itself and activations are not).

Each measurement runs in a fresh process (or torchrun job); the arms alternate within every
repeat; tables show medians.

    .venv/bin/python benchmarks/distributed_scaling.py [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
from sft_throughput import load_samples, write_data

import plumbing.threads  # noqa: F401  (before torch: the project's OpenMP settings)

ARMS = {"1x2": "1 process × 2 threads", "2x1": "2 processes × 1 thread (FSDP2, gloo)"}


# ----- the child (one process, or every rank of a torchrun job) --------------------------------


def grpo_batch(n_groups: int, n_per_group: int):
    """A deterministic scored batch: prompts of 40 tokens, responses of 24-64, rewards 0/1."""
    from rollouts.types import RolloutBatch, Sample

    groups = []
    for g in range(n_groups):
        prompt = tuple(5 + (g * 7 + k) % 200 for k in range(40))
        samples = []
        for i in range(n_per_group):
            n = 24 + (g * 13 + i * 7) % 41
            response = tuple(5 + (g + i + 3 * k) % 200 for k in range(n))
            samples.append(Sample(prompt, response, (1,) * n, group_id=g, index_in_group=i)
                           .with_reward(float((g + i) % 2)))  # fmt: skip
        groups.append(tuple(samples))
    return RolloutBatch(tuple(groups), 1, 0)


async def measure(args) -> dict:
    from functools import partial

    from training.backend.pytorch import PyTorchTrainingBackend, load_model
    from training.config import OptimConfig
    from training.rl.algorithms import grpo
    from training.rl.batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn

    tok, samples = load_samples(args.model_dir, args.data_file, 256, args.sft_steps * 32)
    optim = OptimConfig(lr=5e-4, schedule="constant")
    model = partial(load_model, str(args.model_dir))
    ckpt = Path(tempfile.mkdtemp())
    sft = PyTorchTrainingBackend(model, tok, optim=optim, max_steps=100, checkpoint_dir=ckpt,
                                 pack_length=256, micro_batch_tokens=8192)  # fmt: skip
    ends, tokens = [time.perf_counter()], []
    for k in range(args.sft_steps):
        step = samples[32 * k : 32 * (k + 1)]
        fb = sft.forward_backward(step)
        await sft.optim_step().result()
        await fb.result()
        ends.append(time.perf_counter())
        tokens.append(sum(len(s) for s in step))
    w = args.warmup
    sft_tps = sum(tokens[w:]) / (ends[-1] - ends[w])
    algorithm = grpo()
    rl = PyTorchTrainingBackend(model, tok, optim=optim, max_steps=100, checkpoint_dir=ckpt,
                                pack_length=None, micro_batch_tokens=4096,
                                collate_fn=partial(collate_rl, pad_id=tok.pad_token_id))  # fmt: skip
    examples = build_examples(grpo_batch(8, 8), algorithm)
    loss, weight = rl_loss_fn(algorithm), loss_weight_fn(algorithm)
    times = []
    for _ in range(args.grpo_updates):
        t0 = time.perf_counter()
        fb = rl.forward_backward(examples, loss_fn=loss, loss_weight_fn=weight)
        await rl.optim_step().result()
        await fb.result()
        times.append(time.perf_counter() - t0)
    return {"sft_tokens_per_s": sft_tps, "grpo_update_s": harness.median(times[w:])}


def child(args) -> None:
    import trio

    from training.config import BackendConfig
    from training.distributed import run_rank0

    result = run_rank0(BackendConfig(num_threads=args.threads), lambda: trio.run(measure, args))
    rank = int(os.environ.get("RANK", "0"))
    (args.out / f"rss_{rank}.json").write_text(json.dumps(harness.peak_rss_mb_self()))
    if result is not None:
        harness.emit(result)


# ----- the parent --------------------------------------------------------------------------


def run_arm(arm: str, args, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    world, threads = (1, 2) if arm == "1x2" else (2, 1)
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone",
                                      f"--nproc_per_node={world}"]  # fmt: skip
    result = harness.run_child(
        [*launcher, __file__, "--child", "--threads", str(threads), "--out", str(out),
         "--model-dir", str(args.model_dir), "--data-file", str(args.data_file),
         "--sft-steps", str(args.sft_steps), "--grpo-updates", str(args.grpo_updates),
         "--warmup", str(args.warmup)],
        env={"OMP_NUM_THREADS": str(threads)},
    )  # fmt: skip
    result["rss_mb"] = [json.loads((out / f"rss_{r}.json").read_text()) for r in range(world)]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sft-steps", type=int, default=8)
    p.add_argument("--grpo-updates", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 repeat")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--data-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    if args.quick:
        harness.apply_quick(args, p, repeats=1, sft_steps=3, grpo_updates=3, warmup=1)
    from training.backend.tiny_model import ensure_tiny_model

    size = "tiny" if args.quick else "small"
    started = time.time()
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = ensure_tiny_model(Path(tmp) / "model", size=size)
        args.data_file = write_data(Path(tmp) / "chat.jsonl", "chat", args.sft_steps * 32)
        for r in range(args.repeats):
            for arm in ARMS if r % 2 == 0 else reversed(ARMS):
                runs[arm].append(run_arm(arm, args, Path(tmp) / f"{arm}_{r}"))
    med = {arm: {k: harness.median(run[k] for run in runs[arm])
                 for k in ("sft_tokens_per_s", "grpo_update_s")} for arm in ARMS}  # fmt: skip
    rss = {arm: max(max(run["rss_mb"]) for run in runs[arm]) for arm in ARMS}
    sft_ratio = med["2x1"]["sft_tokens_per_s"] / med["1x2"]["sft_tokens_per_s"]
    grpo_ratio = med["1x2"]["grpo_update_s"] / med["2x1"]["grpo_update_s"]
    rows = [[ARMS[arm], med[arm]["sft_tokens_per_s"], med[arm]["grpo_update_s"], rss[arm]]
            for arm in ARMS]  # fmt: skip
    table = harness.md_table(["arm", "SFT tokens/s", "GRPO update (s)", "peak RSS per rank (MiB)"],
                             rows)  # fmt: skip
    notes = [
        f"- SFT throughput, 2 processes / 1 process: {harness.verdict(sft_ratio, 0.8)}",
        f"- GRPO update speed, 2 processes / 1 process: {harness.verdict(grpo_ratio, 0.8)}",
        f"- peak RSS per rank, 2 processes / 1 process: {rss['2x1'] / rss['1x2']:.2f}x "
        "(parameters, gradients and AdamW state are halved; torch's own ~300 MiB and the "
        "activations are not)",
        f"- `{size}` model; {args.sft_steps} SFT steps of 32 chat samples and "
        f"{args.grpo_updates} GRPO updates of 64 samples, first {args.warmup} untimed; medians "
        f"of {args.repeats} repeats, arms alternating",
    ]
    harness.publish("distributed_scaling", "FSDP2 on CPU: 2 processes vs 1",
                    "FSDP2 overhead on CPU (2 cores)", [table], notes, quick=args.quick,
                    started=started)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
