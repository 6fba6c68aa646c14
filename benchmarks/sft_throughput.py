"""SFT throughput: run_sft_training vs a minimal raw PyTorch loop, side by side in one run.

Both train the same freshly initialised tiny model on the same tokenized arithmetic samples with
the same samples per step, AdamW and grad clipping. The raw loop is what one would write by hand:
each step it builds the batch tensors from the step's samples (with this project's packing, so
both do the same arithmetic) and runs forward, backward, clip and step inline. The ratio is
therefore the framework's overhead: the ordered worker thread and futures, micro-batch planning,
the DataBuffer and metrics. A third column is a raw loop on padded (unpacked) rows, the usual
baseline, and the padding efficiency with and without packing is printed. Runs alternate A/B and report the median of
--repeats. Prints a table and the ratio (target >= 0.95).

    .venv/bin/python benchmarks/sft_throughput.py [--steps 60] [--repeats 3] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

from rollouts.tasks.arithmetic import make_problems
from training.backend import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig, SFTLoopConfig
from training.data_buffer import DataBuffer
from training.packing import forward_logits, prepare_sft_batch, sft_loss
from training.sft import SFTData, run_sft_training
from training.tiny_model import build_tiny_model
from training.tokenize import tokenize_conversation

OPTIM = OptimConfig(lr=1e-3, schedule="constant", grad_clip=1.0)


def run_rollouts(model_dir: Path, samples, args, out: Path) -> float:
    model, tok = load_model_and_tokenizer(model_dir)
    backend = PyTorchTrainingBackend(
        model, tok, optim=OPTIM, max_steps=args.steps, checkpoint_dir=out / "ckpt",
        micro_batch_tokens=args.micro_batch_tokens, pack_length=args.pack_length,
    )  # fmt: skip
    config = SFTLoopConfig(
        batch_size=args.batch_size, max_steps=args.steps, eval_every=10**9,
        checkpoint_every=10**9, eval_samples=0, resume="never",
    )  # fmt: skip
    data = SFTData(DataBuffer(samples, seed=0, shuffle=False))
    with backend:
        history = trio.run(run_sft_training, backend, data, config)
    # Per-step wall time as the loop measures it (batch fetch, micro-batch planning, collation,
    # forward/backward, optimizer step and both futures); the final checkpoint is excluded.
    return sum(m["n_tokens"] for m in history) / sum(m["step_time_s"] for m in history)


def step_chunks(samples, args):
    return [samples[s * args.batch_size :][: args.batch_size] for s in range(args.steps)]


def raw_batches(samples, args, tok, packing: bool):
    return [
        prepare_sft_batch(chunk, pad_id=tok.pad_token_id, packing=packing,
                          max_tokens_per_row=args.pack_length)
        for chunk in step_chunks(samples, args)
    ]  # fmt: skip


def run_raw(model_dir: Path, samples, args, packing: bool) -> float:
    model, tok = load_model_and_tokenizer(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps)
    t0 = time.perf_counter()
    n_tokens = 0
    for chunk in step_chunks(samples, args):
        batch = prepare_sft_batch(chunk, pad_id=tok.pad_token_id, packing=packing,
                                  max_tokens_per_row=args.pack_length)  # fmt: skip
        loss, _ = sft_loss(forward_logits(model, batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n_tokens += batch.n_tokens
    return n_tokens / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--pack-length", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_model(tmp / "model", seed=0, size=args.size)
        _, tok = load_model_and_tokenizer(model_dir)
        problems = make_problems(args.steps * args.batch_size, seed=0, min_digits=1, max_digits=3)
        samples = [tokenize_conversation(tok, p.sft_record()["messages"]) for p in problems]
        # the framework gets the samples in order (shuffle off) so both see identical batches
        packed = raw_batches(samples, args, tok, packing=True)
        padded = raw_batches(samples, args, tok, packing=False)
        eff_packed = sum(b.n_tokens for b in packed) / sum(b.n_slots for b in packed)
        eff_padded = sum(b.n_tokens for b in padded) / sum(b.n_slots for b in padded)

        results: dict[str, list[float]] = {"rollouts": [], "raw_packed": [], "raw_padded": []}
        for r in range(args.repeats):
            results["raw_packed"].append(run_raw(model_dir, samples, args, packing=True))
            results["rollouts"].append(run_rollouts(model_dir, samples, args, tmp / f"run{r}"))
            results["raw_padded"].append(run_raw(model_dir, samples, args, packing=False))

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"SFT throughput, {args.size} model, {args.steps} steps x {args.batch_size} samples, "
          f"{args.threads} threads, median of {args.repeats} (non-pad tokens/s)")  # fmt: skip
    print(f"{'loop':<28}{'tokens/s':>12}{'all runs':>36}")
    for name, label in [("rollouts", "run_sft_training (packed)"),
                        ("raw_packed", "raw PyTorch (same packed)"),
                        ("raw_padded", "raw PyTorch (padded rows)")]:  # fmt: skip
        runs = ", ".join(f"{v:,.0f}" for v in results[name])
        print(f"{label:<28}{med[name]:>12,.0f}{runs:>36}")
    ratio = med["rollouts"] / med["raw_packed"]
    print(f"ratio run_sft_training / raw loop (packed):       {ratio:.3f}  (target >= 0.95)")
    print(
        f"ratio run_sft_training / raw loop (padded rows):  {med['rollouts'] / med['raw_padded']:.3f}"
    )
    print(f"padding efficiency: packed {eff_packed:.3f}, unpacked {eff_padded:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
