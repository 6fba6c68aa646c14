"""SFT throughput: run_sft_training vs a minimal raw PyTorch loop, side by side in one run.

Both train the same freshly initialised model on the same tokenized arithmetic samples with the
same samples per step, AdamW and grad clipping. The raw loop is what one would write by hand:
each step it builds the batch tensors from the step's samples (with this project's packing, so
both do the same arithmetic) and runs forward, backward, clip and step inline. The ratio is
therefore the framework's overhead: the ordered worker thread and futures, micro-batch
planning, the DataBuffer and metrics. A third column is a raw loop on padded (unpacked) rows,
the usual baseline, and the padding efficiency with and without packing is printed.

Every measurement runs in a fresh process (one OpenMP thread team per process, as in real use;
see rollouts/threads.py), the three loops alternate, and the median of --repeats is reported.

    .venv/bin/python benchmarks/sft_throughput.py [--steps 60] [--repeats 3] [--size tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rollouts.threads  # noqa: F401  (before torch: the project's OpenMP settings)

LOOPS = {
    "rollouts": "run_sft_training (packed)",
    "raw_packed": "raw PyTorch (packed)",
    "raw_padded": "raw PyTorch (padded rows)",
}


def make_samples(model_dir: Path, n: int):
    from rollouts.tasks.arithmetic import make_problems
    from training.backend import load_tokenizer
    from training.tokenize import tokenize_conversation

    tok = load_tokenizer(model_dir)
    problems = make_problems(n, seed=0, min_digits=1, max_digits=3)
    return tok, [tokenize_conversation(tok, p.sft_record()["messages"]) for p in problems]


def measure(loop: str, model_dir: Path, args) -> dict:
    """One measurement in this process; returns tokens/s and padding efficiency."""
    import torch
    import trio

    from training.backend import PyTorchTrainingBackend, load_model
    from training.config import OptimConfig, SFTLoopConfig
    from training.data_buffer import DataBuffer
    from training.packing import forward_logits, prepare_sft_batch, sft_loss
    from training.sft import SFTData, run_sft_training

    optim = OptimConfig(lr=1e-3, schedule="constant", grad_clip=1.0)
    tok, samples = make_samples(model_dir, args.steps * args.batch_size)
    if loop == "rollouts":
        backend = PyTorchTrainingBackend(
            lambda: load_model(model_dir), tok, optim=optim, max_steps=args.steps,
            checkpoint_dir=Path(tempfile.mkdtemp()), micro_batch_tokens=args.micro_batch_tokens,
            pack_length=args.pack_length, num_threads=args.threads,
        )  # fmt: skip
        config = SFTLoopConfig(batch_size=args.batch_size, max_steps=args.steps,
                               eval_every=10**9, checkpoint_every=10**9, eval_samples=0,
                               resume="never")  # fmt: skip
        with backend:
            history = trio.run(run_sft_training, backend,
                               SFTData(DataBuffer(samples, seed=0, shuffle=False)), config)  # fmt: skip
        # per-step wall time as the loop measures it; the final checkpoint is excluded
        tokens = sum(m["n_tokens"] for m in history)
        seconds = sum(m["step_time_s"] for m in history)
        slots = sum(m["n_tokens"] / m["padding_efficiency"] for m in history)
        return {"tokens_per_s": tokens / seconds, "padding_efficiency": tokens / slots}
    torch.set_num_threads(args.threads)
    model = load_model(model_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps)
    packing = loop == "raw_packed"
    tokens = slots = 0
    t0 = time.perf_counter()
    for k in range(args.steps):
        chunk = samples[k * args.batch_size : (k + 1) * args.batch_size]
        batch = prepare_sft_batch(chunk, pad_id=tok.pad_token_id, packing=packing,
                                  max_tokens_per_row=args.pack_length)  # fmt: skip
        loss, _ = sft_loss(forward_logits(model, batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += batch.n_tokens
        slots += batch.n_slots
    return {
        "tokens_per_s": tokens / (time.perf_counter() - t0),
        "padding_efficiency": tokens / slots,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--pack-length", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    p.add_argument("--one", choices=list(LOOPS), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:  # child process: one measurement, printed as JSON
        print(json.dumps(measure(args.one, args.model_dir, args)))
        return 0

    from training.tiny_model import build_tiny_model

    results: dict[str, list[dict]] = {k: [] for k in LOOPS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0, size=args.size)
        passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                       if k not in ("one", "model_dir", "repeats")]  # fmt: skip
        for _ in range(args.repeats):
            for loop in LOOPS:
                out = subprocess.run(
                    [sys.executable, __file__, "--one", loop, "--model-dir", str(model_dir),
                     *passthrough], capture_output=True, text=True, check=True,
                )  # fmt: skip
                results[loop].append(json.loads(out.stdout.strip().splitlines()[-1]))

    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
    print(f"SFT throughput, {args.size} model, {args.steps} steps x {args.batch_size} samples, "
          f"{args.threads} threads, median of {args.repeats}, one process per run "
          "(non-pad tokens/s)")  # fmt: skip
    print(f"{'loop':<28}{'tokens/s':>12}{'all runs':>30}")
    for loop, label in LOOPS.items():
        runs = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in results[loop])
        print(f"{label:<28}{med[loop]:>12,.0f}{runs:>30}")
    print(f"ratio run_sft_training / raw loop (packed):      {med['rollouts'] / med['raw_packed']:.3f}"
          "  (target >= 0.95)")  # fmt: skip
    print(
        f"ratio run_sft_training / raw loop (padded rows): {med['rollouts'] / med['raw_padded']:.3f}"
    )
    eff = {k: statistics.median(r["padding_efficiency"] for r in v) for k, v in results.items()}
    print(f"padding efficiency: packed {eff['rollouts']:.3f}, unpacked {eff['raw_padded']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
