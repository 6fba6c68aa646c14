"""SFT throughput: run_sft_training vs TRL's SFTTrainer vs raw PyTorch loops; the MFU ceiling.

Loops, all on the same freshly initialised model, the same tokenized samples in the same order,
the same samples per optimizer step (no gradient accumulation), the same sequence limit, AdamW
(betas 0.9/0.95, no weight decay), a constant learning rate, grad clipping at 1.0, fp32 and the
same torch thread count:
- rollouts          `run_sft_training` + `PyTorchTrainingBackend` (packed rows, as the recipe)
- raw_packed        a hand-written loop over the same packed batches (the framework's overhead)
- raw_padded        the minimal hand-written loop: one sample per row, right-padded
- trl               TRL `SFTTrainer` with its defaults (pads each batch to its longest sample)
- trl_packing       TRL `SFTTrainer(packing=True)`, TRL at its best on this data: samples packed
                    into rows of `--pack-length` (its default best-fit-decreasing strategy,
                    position ids per sample), as many rows per step as carry the tokens of
                    `--batch-size` samples; its tokens per step are read from its packed dataset
- trl_packing_wrapped  TRL `SFTTrainer(packing=True, packing_strategy="wrapped")`: the token
                    stream cut into full rows with no per-sample isolation (attention crosses
                    sample boundaries: faster, not the same training; TRL's fastest packing)
- trl_padding_free  TRL `SFTTrainer(padding_free=True)`: the batch flattened into one row
                    (opt-in with --loops: slower than TRL's default here, since one row of
                    ~2,600 tokens makes attention quadratic in the whole batch)
Assistant-only loss everywhere. TRL is given our token ids plus an `assistant_masks` column,
from which it builds the labels itself: its `assistant_only_loss` flag would need
`{% generation %}` markers, which the tiny model's chat template does not have, and TRL cannot
patch a template it does not know. TRL keeps its default optimizer (fused AdamW).

Data (`--data`): `chat` (default) is mixed-length chat, 1-4 arithmetic question/answer turns
with an optional system prompt (15-130 tokens, where packing matters); `arithmetic` is the
SFT recipe's single-turn data (about 19 tokens per sample, where it hardly does).

Throughput = non-padding tokens per second of the training steps after `--warmup` (batch
building, forward, backward, clip, optimizer step; each loop timestamps its own step ends).
Each measurement runs in a fresh process; the loops alternate (rotated order) within every
repeat; tables show medians of `--repeats`. The mean loss is printed as a check that every
loop trains the same thing.

Physical ceiling: fp32 matmul GFLOP/s with `--threads` threads, measured in its own process in
every repeat. MFU = 6 · N · tokens/s / ceiling, with N the parameters minus the input
embedding (a lookup, no FLOPs); attention-score FLOPs (~1 % here) are left out.

    .venv/bin/python benchmarks/sft_throughput.py [--sizes tiny,small] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path

import plumbing.threads  # noqa: F401  (before torch: the project's OpenMP settings)

LOOPS = {
    "rollouts": "run_sft_training (packed)",
    "raw_packed": "raw PyTorch (packed)",
    "raw_padded": "raw PyTorch (padded rows)",
    "trl": "TRL SFTTrainer (padded)",
    "trl_packing": "TRL SFTTrainer (packing)",
    "trl_packing_wrapped": "TRL SFTTrainer (packing, wrapped)",
    "trl_padding_free": "TRL SFTTrainer (padding_free)",
}
LR = 5e-4
SYSTEM_PROMPTS = (
    None,
    "Be brief.",
    "You are a careful calculator. Answer with the number only.",
    "You are a helpful assistant that does arithmetic. Reply with the exact result of each "
    "expression the user sends, as digits, and nothing else: no words, no units.",
)


def write_data(path: Path, kind: str, n: int, seed: int = 0) -> Path:
    """Deterministic SFT JSONL: mixed-length chat or the recipe's single-turn arithmetic."""
    from rollouts.tasks.arithmetic import make_problem, write_jsonl

    rng = random.Random(seed)
    records = []
    for _ in range(n):
        if kind == "arithmetic":
            records.append(make_problem(rng, min_digits=1, max_digits=2, ops="+").sft_record())
            continue
        system = rng.choice(SYSTEM_PROMPTS)
        messages = [{"role": "system", "content": system}] if system else []
        for _ in range(rng.randint(1, 4)):
            p = make_problem(rng, min_digits=1, max_digits=3, ops="+-")
            messages += [{"role": "user", "content": p.question},
                         {"role": "assistant", "content": p.answer}]  # fmt: skip
        records.append({"messages": messages})
    return write_jsonl(path, records)


def load_samples(model_dir: Path, data_file: Path, max_seq_len: int, n: int):
    """The first `n` records of the JSONL, tokenized with assistant-only loss masks."""
    from training.backend.pytorch import load_tokenizer
    from training.data.sft_data import load_sft_jsonl
    from training.data.tokenize import tokenize_records

    tok = load_tokenizer(model_dir)
    samples, _ = tokenize_records(load_sft_jsonl(data_file)[:n], tok, max_seq_len=max_seq_len)
    if len(samples) < n:
        raise SystemExit(f"{data_file}: {len(samples)} usable samples, {n} needed")
    return tok, samples


# ----- one measurement per child process ------------------------------------------------------


def measure(loop: str, args) -> dict:
    """Train `args.steps` steps with `loop`; return per-step end times and the mean loss."""
    import torch

    n = args.steps * args.batch_size
    tok, samples = load_samples(args.model_dir, args.data_file, args.max_seq_len, n)
    torch.set_num_threads(args.threads)
    if loop == "rollouts":
        ends, losses = _rollouts_loop(tok, samples, args)
    elif loop.startswith("raw"):
        ends, losses = _raw_loop(tok, samples, args, packing=loop == "raw_packed")
    else:
        ends, losses, counts = _trl_loop(tok, samples, args,
                                         padding_free=loop == "trl_padding_free",
                                         packing=loop.startswith("trl_packing"),
                                         wrapped=loop == "trl_packing_wrapped")  # fmt: skip
        if counts is not None:
            return {"ends": ends, "mean_loss": losses, "threads": torch.get_num_threads(),
                    "rss_mb": harness.peak_rss_mb_self(), **counts}  # fmt: skip
    return {"ends": ends, "mean_loss": losses, "threads": torch.get_num_threads(),
            "rss_mb": harness.peak_rss_mb_self()}  # fmt: skip


def _rollouts_loop(tok, samples, args) -> tuple[list[float], float]:
    import trio

    from training.backend.pytorch import PyTorchTrainingBackend, load_model
    from training.config import OptimConfig, SFTLoopConfig
    from training.data.buffer import DataBuffer
    from training.loops.hooks import SFTHooks
    from training.loops.sft import SFTData, run_sft_training

    optim = OptimConfig(lr=LR, schedule="constant", grad_clip=1.0)
    backend = PyTorchTrainingBackend(
        lambda: load_model(args.model_dir), tok, optim=optim, max_steps=args.steps,
        checkpoint_dir=Path(tempfile.mkdtemp()), micro_batch_tokens=args.micro_batch_tokens,
        pack_length=args.pack_length, num_threads=args.threads,
    )  # fmt: skip
    config = SFTLoopConfig(batch_size=args.batch_size, max_steps=args.steps, eval_every=10**9,
                           checkpoint_every=10**9, eval_samples=0, resume="never")  # fmt: skip
    ends: list[float] = []
    with backend:
        history = trio.run(
            lambda: run_sft_training(
                backend, SFTData(DataBuffer(samples, seed=0, shuffle=False)), config,
                hooks=SFTHooks(logger=lambda step, m: ends.append(time.perf_counter())),
            )
        )  # fmt: skip
    ends.insert(0, ends[0] - history[0]["step_time_s"])  # the first step's start
    return ends, statistics.fmean(m["loss"] for m in history)


def _raw_loop(tok, samples, args, *, packing: bool) -> tuple[list[float], float]:
    import torch

    from training.backend.pytorch import load_model
    from training.data.packing import forward_logits, prepare_sft_batch, sft_loss

    model = load_model(args.model_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)  # fmt: skip
    ends, losses = [time.perf_counter()], []
    for k in range(args.steps):
        chunk = samples[k * args.batch_size : (k + 1) * args.batch_size]
        batch = prepare_sft_batch(chunk, pad_id=tok.pad_token_id, packing=packing,
                                  max_tokens_per_row=args.pack_length)  # fmt: skip
        loss, metrics = sft_loss(forward_logits(model, batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(metrics["loss"])
        ends.append(time.perf_counter())
    return ends, statistics.fmean(losses)


def _trl_loop(tok, samples, args, *, padding_free: bool, packing: bool = False,
              wrapped: bool = False):  # fmt: skip
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from training.backend.pytorch import load_model

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.ends:
                self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    data = Dataset.from_dict({"input_ids": [list(s.input_ids) for s in samples],
                              "assistant_masks": [list(s.loss_mask) for s in samples]})  # fmt: skip
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, seed=0, report_to="none",
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        max_steps=args.steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
        bf16=False, fp16=False, gradient_checkpointing=False, packing=packing,
        packing_strategy="wrapped" if wrapped else "bfd",
        padding_free=padding_free,
        max_length=args.pack_length if packing else None if padding_free else args.max_seq_len,
        train_sampling_strategy="sequential", shuffle_dataset=False, dataloader_num_workers=0,
        logging_strategy="steps", logging_steps=args.steps, save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    if packing:  # rows of pack_length: as many per step as carry one batch's tokens
        tokens = sum(len(s) for s in samples) / args.steps
        config.per_device_train_batch_size = max(1, round(tokens / args.pack_length))
    clock = Clock()
    trainer = SFTTrainer(model=load_model(args.model_dir), args=config, train_dataset=data,
                         processing_class=tok, callbacks=[clock])  # fmt: skip
    result = trainer.train()
    counts = None
    if packing:  # TRL's own steps carry other tokens than ours: count them from its rows
        rows, b = trainer.train_dataset, config.per_device_train_batch_size
        mask_key = next((k for k in ("assistant_masks", "completion_mask")
                         if k in rows.column_names), None)  # fmt: skip
        counts = {"tokens": [], "trained": []}
        for k in range(args.steps):
            chunk = rows[k * b : (k + 1) * b]
            counts["tokens"].append(sum(len(r) for r in chunk["input_ids"]))
            # TRL drops the mask column when it packs: trained tokens are then unknown (NaN)
            counts["trained"].append(sum(sum(m) for m in chunk[mask_key]) if mask_key
                                     else float("nan"))  # fmt: skip
    return clock.ends, float(result.training_loss), counts


def measure_ceiling(args) -> dict:
    """fp32 matmul GFLOP/s on `args.threads` threads (median of bursts of square matmuls)."""
    import torch

    torch.set_num_threads(args.threads)
    n = args.matmul_size
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    rates = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        rates.append(4 * 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return {"gflops": statistics.median(rates), "best_gflops": max(rates)}


# ----- the side-by-side run ------------------------------------------------------------------


def step_tokens(model_dir: Path, args) -> tuple[list[int], list[int], int, int]:
    """Non-pad and trained tokens of every step (identical for all loops), and param counts."""
    from training.backend.pytorch import load_model

    n = args.steps * args.batch_size
    _, samples = load_samples(model_dir, args.data_file, args.max_seq_len, n)
    b = args.batch_size
    chunks = [samples[k * b : (k + 1) * b] for k in range(args.steps)]
    tokens = [sum(len(s) for s in c) for c in chunks]
    trained = [sum(s.n_trained for s in c) for c in chunks]
    model = load_model(model_dir)
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    return tokens, trained, total, total - embed


def rates(ends: list[float], tokens: list[int], warmup: int) -> float:
    """Tokens/s over the steps after `warmup` (ends[0] is the first step's start)."""
    return sum(tokens[warmup:]) / (ends[-1] - ends[warmup])


def run_size(size: str, args, tmp: Path) -> dict:
    from training.backend.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp / size, seed=0, size=size)
    steps = args.steps_tiny if size == "tiny" else args.steps_small
    args.steps, args.model_dir = steps, model_dir
    tokens, trained, n_params, n_matmul = step_tokens(model_dir, args)
    passthrough = [f"--data-file={args.data_file}", f"--model-dir={model_dir}",
                   f"--steps={steps}", f"--batch-size={args.batch_size}",
                   f"--pack-length={args.pack_length}", f"--max-seq-len={args.max_seq_len}",
                   f"--micro-batch-tokens={args.micro_batch_tokens}", f"--threads={args.threads}",
                   f"--matmul-size={args.matmul_size}"]  # fmt: skip
    runs: dict[str, list[dict]] = {k: [] for k in [*args.loops, "ceiling"]}
    for r in range(args.repeats):
        order = args.loops[r % len(args.loops) :] + args.loops[: r % len(args.loops)]
        for loop in [*order, "ceiling"]:
            print(f"  [{size} repeat {r + 1}/{args.repeats}] {loop} ...", flush=True)
            out = harness.run_child([__file__, "--one", loop, *passthrough])
            if loop != "ceiling":  # TRL packing reports its own per-step counts
                out["tokens_per_s"] = rates(out["ends"], out.get("tokens", tokens), args.warmup)
                out["trained_per_s"] = rates(out["ends"], out.get("trained", trained),
                                             args.warmup)  # fmt: skip
            runs[loop].append(out)
    return {"runs": runs, "n_params": n_params, "n_matmul": n_matmul, "steps": steps,
            "tokens_per_step": statistics.fmean(tokens)}  # fmt: skip


def report(results: dict, args, started: float) -> None:
    ceilings = [c["gflops"] for s in results.values() for c in s["runs"]["ceiling"]]
    ceiling = harness.median(ceilings)
    rows, notes, bars = [], [], {}
    for size, res in results.items():
        runs = res["runs"]
        med = {k: harness.median(r["tokens_per_s"] for r in runs[k]) for k in args.loops}
        flops_per_token = 6 * res["n_matmul"]
        for loop in args.loops:
            vals = [r["tokens_per_s"] for r in runs[loop]]
            mfu = flops_per_token * med[loop] / (ceiling * 1e9)
            rows.append([size, LOOPS[loop], med[loop],
                         harness.median(r["trained_per_s"] for r in runs[loop]),
                         med[loop] / med.get("trl", float("nan")),
                         f"{mfu:.0%}", harness.median(r["mean_loss"] for r in runs[loop]),
                         ", ".join(f"{v:,.0f}" for v in vals)])  # fmt: skip
        bars[size] = med
        ours = med.get("rollouts", float("nan"))
        if "trl" in med:
            notes.append(f"- {size}: run_sft_training / TRL SFTTrainer = "
                         f"{harness.verdict(ours / med['trl'], 1.5)}")  # fmt: skip
        if "trl_packing" in med:
            notes.append(f"- {size}: run_sft_training / TRL SFTTrainer with packing (TRL at its "
                         f"best) = {harness.verdict(ours / med['trl_packing'], 1.0)}")  # fmt: skip
        if "trl_packing_wrapped" in med:
            notes.append(f"- {size}: run_sft_training / TRL packing, wrapped (no sample "
                         f"isolation) = {ours / med['trl_packing_wrapped']:.2f}x")  # fmt: skip
        if "trl_padding_free" in med:
            notes.append(f"- {size}: run_sft_training / TRL padding_free = "
                         f"{ours / med['trl_padding_free']:.2f}x")  # fmt: skip
        if "raw_padded" in med:
            notes.append(f"- {size}: run_sft_training / minimal raw loop (padded) = "
                         f"{harness.verdict(ours / med['raw_padded'], 0.95)}")  # fmt: skip
        if "raw_packed" in med:
            notes.append(f"- {size}: run_sft_training / raw loop on the same packed batches "
                         f"(framework overhead) = {harness.verdict(ours / med['raw_packed'], 0.95)}")  # fmt: skip
        notes.append(f"- {size}: {res['n_params'] / 1e6:.1f} M parameters "
                     f"({res['n_matmul'] / 1e6:.1f} M in matmuls), {res['steps']} steps of "
                     f"{args.batch_size} samples ({res['tokens_per_step']:.0f} non-pad tokens per "
                     f"step), first {args.warmup} untimed")  # fmt: skip
    headers = ["model", "loop", "tokens/s", "trained tok/s", "vs TRL", "MFU", "mean loss",
               f"runs (tokens/s, {args.repeats} repeats)"]  # fmt: skip
    table = harness.md_table(headers, rows)
    ceiling_line = (f"Physical ceiling: fp32 matmul {ceiling:.0f} GFLOP/s on {args.threads} "
                    f"threads ({args.matmul_size}x{args.matmul_size}, median of "
                    f"{len(ceilings)} measurements; best {max(c['best_gflops'] for s in results.values() for c in s['runs']['ceiling']):.0f}). "
                    "MFU = 6 x matmul params x tokens/s / ceiling.")  # fmt: skip
    print(f"\nSFT throughput ({args.data} data, non-pad tokens/s, median of {args.repeats})")
    print(table)
    print(ceiling_line)
    print("\n".join(notes))
    png = plot(bars, args)
    body = (
        f"Data: `{args.data}` ({'mixed-length chat, 1-4 turns' if args.data == 'chat' else 'single-turn arithmetic'}); "
        f"{args.batch_size} samples per step, max {args.max_seq_len} tokens, "
        f"pack length {args.pack_length}, {args.threads} torch threads, lr {LR} constant.\n\n"
        f"{table}\n\n{ceiling_line}\n\n" + "\n".join(notes) + "\n\n"
        + harness.image_link(png, args.quick, "SFT throughput")
    )  # fmt: skip
    harness.write_section("sft_throughput", "SFT throughput and the physical ceiling", body,
                          quick=args.quick, started=started)  # fmt: skip


def plot(bars: dict[str, dict[str, float]], args) -> Path | None:
    plt = harness.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(bars), figsize=(5 * len(bars), 3.6), squeeze=False)
    for ax, (size, med) in zip(axes[0], bars.items(), strict=True):
        labels = [LOOPS[k].replace(" (", "\n(") for k in med]
        colors = ["tab:green" if k == "rollouts" else "tab:gray" if k.startswith("raw")
                  else "tab:orange" for k in med]  # fmt: skip
        ax.bar(range(len(med)), list(med.values()), color=colors)
        ax.set_xticks(range(len(med)), labels, fontsize=7)
        ax.set_title(f"{size} model")
        ax.set_ylabel("non-pad tokens/s")
    fig.suptitle(f"SFT throughput ({args.data} data, median of {args.repeats})")
    return harness.save_figure(fig, "sft_throughput", args.quick)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,small", help="comma-separated: tiny,small")
    p.add_argument("--loops",
                   default="rollouts,raw_packed,raw_padded,trl,trl_packing,trl_packing_wrapped",
                   help=f"comma-separated, of: {', '.join(LOOPS)}")  # fmt: skip
    p.add_argument("--data", choices=["chat", "arithmetic"], default="chat")
    p.add_argument("--steps-tiny", type=int, default=24)
    p.add_argument("--steps-small", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start")
    p.add_argument("--repeats", type=int, default=5,
                   help="the same loop varies by about +-10%% from one process to the next here, "
                        "so medians need several")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--pack-length", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--matmul-size", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 repeat, 5 steps")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--data-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:  # child process: one measurement
        harness.emit(measure_ceiling(args) if args.one == "ceiling" else measure(args.one, args))
        return 0
    if args.quick:
        harness.apply_quick(args, p, sizes="tiny", repeats=1, steps_tiny=5)
    args.loops = args.loops.split(",")
    started = time.time()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        n = max(args.steps_tiny, args.steps_small) * args.batch_size
        args.data_file = write_data(Path(tmp) / f"{args.data}.jsonl", args.data, n)
        for size in args.sizes.split(","):
            results[size] = run_size(size, args, Path(tmp))
    report(results, args, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
