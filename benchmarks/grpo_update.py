"""Where a GRPO update's time goes, and what sharing each group's prompt saves.

The GRPO step of rl_tiny is dominated by the update (forward + backward over B x G sequences
of prompt + response), and the update is compute-bound. On one batch of that shape (real
arithmetic prompts through the chat template, responses of 2..`--max-response` tokens) this
times forward + backward of the same GRPO loss three ways, alternating, in one process:
- shared_prompt: `PyTorchTrainingBackend.forward_backward` with the RL loss as the loop runs it
  (the default `share_prompts=True`): one model row per group, [prompt, response 1, ...,
  response G], with a tree attention mask and positions continuing after the prompt
  (training/data/prefix_sharing.py);
- backend_per_sample: the same call with `share_prompts=False`: one row per sample;
- per_sample: that layout inline, without the backend (the bare compute).
It checks that the shared rows give the same logprobs and gradients as one row per sample
(float tolerance) and reports the speed-up.

    .venv/bin/python benchmarks/grpo_update.py [--threads 1,2] [--reps 8] [--quick]
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


def make_groups(tok, args) -> list[tuple[list[int], list[list[int]]]]:
    """(prompt ids, G response id lists) per group: real prompts, random response tokens."""
    from rollouts.prompts import encode_prompt
    from rollouts.tasks.arithmetic import make_problems

    rng = random.Random(0)
    problems = make_problems(args.prompts, seed=0, min_digits=1, max_digits=2, ops="+")
    eos = tok.eos_token_id
    return [(encode_prompt(tok, p.messages()),
             [[rng.randrange(3, 200) for _ in range(rng.randint(1, args.max_response - 1))] + [eos]
              for _ in range(args.group)]) for p in problems]  # fmt: skip


def per_sample_logprobs(model, groups, pad: int):
    """One row per sample (today's layout); response logprobs left-aligned [S, L] + mask."""
    import torch

    from training.data.packing import token_logprobs

    samples = [(p, r) for p, rs in groups for r in rs]
    width = max(len(p) + len(r) for p, r in samples)
    longest = max(len(r) for _, r in samples)
    ids = torch.full((len(samples), width), pad)
    tgt = torch.full((len(samples), width), -100)
    for i, (p, r) in enumerate(samples):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        tgt[i, len(p) - 1 : len(p) + len(r) - 1] = torch.tensor(r)
    pos = torch.arange(width).expand(len(samples), width)
    logits = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits
    lp = token_logprobs(logits, tgt)
    out, mask = torch.zeros(len(samples), longest), torch.zeros(len(samples), longest)
    for i, (_, r) in enumerate(samples):
        out[i, : len(r)] = lp[i][tgt[i] != -100]
        mask[i, : len(r)] = 1
    return out, mask, ids.numel()


def grpo_loss(lp, mask, adv):
    """GRPO with one update per batch: ratio 1 (old = detached), per-sequence token mean."""
    import torch

    ratio = torch.exp(lp - lp.detach())
    return -((ratio * adv[:, None] * mask).sum(1) / mask.sum(1)).mean()


def library_logprobs_and_grads(model, examples, pad: int):
    """Per-token logprobs [S, T] and gradients of the library's GRPO loss on one micro-batch."""
    from training.data.packing import forward_logits, token_logprobs
    from training.rl.algorithms import grpo
    from training.rl.batch import collate_rl, rl_loss_fn

    model.zero_grad(set_to_none=True)
    batch = collate_rl(examples, pad_id=pad)
    logits = forward_logits(model, batch)
    rl_loss_fn(grpo())(logits, batch)[0].backward()
    lp = token_logprobs(logits, batch.target_ids).detach()
    return lp, {k: p.grad.clone() for k, p in model.named_parameters()}, batch.n_slots


def measure(threads: int, args) -> dict:
    import torch
    import trio

    from rollouts.types import RolloutBatch, Sample
    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.backend.tiny_model import build_tiny_model
    from training.config import OptimConfig
    from training.rl.algorithms import grpo
    from training.rl.batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn

    torch.set_num_threads(threads)
    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "model", seed=0)
    tok = load_tokenizer(model_dir)
    model, pad = load_model(model_dir).train(), tok.pad_token_id
    groups = make_groups(tok, args)
    rng = random.Random(1)
    rewards = [[float(rng.random() < 0.5) for _ in rs] for _, rs in groups]
    batch = RolloutBatch(tuple(tuple(Sample(tuple(p), tuple(r), (1,) * len(r), (-1.0,) * len(r),
                                            reward=rw, group_id=g, index_in_group=i)
                                     for i, (r, rw) in enumerate(zip(rs, rewards[g], strict=True)))
                               for g, (p, rs) in enumerate(groups)), 0, 0, {})  # fmt: skip
    shared = build_examples(batch, grpo())
    per_sample = build_examples(batch, grpo(), share_prompts=False)
    adv = torch.tensor([e.advantage for e in shared])

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        lp, mask, _ = per_sample_logprobs(model, groups, pad)
        grpo_loss(lp, mask, adv).backward()

    a_lp, a_grad, a_slots = library_logprobs_and_grads(model, per_sample, pad)
    b_lp, b_grad, b_slots = library_logprobs_and_grads(model, shared, pad)
    checks = {
        "logprob_max_abs_diff": (a_lp - b_lp).abs().max().item(),
        "grad_max_rel_diff": max(((a_grad[k] - b_grad[k]).abs().max()
                                  / a_grad[k].abs().max().clamp(min=1e-12)).item() for k in a_grad),
    }  # fmt: skip
    backend = PyTorchTrainingBackend(
        lambda: load_model(model_dir), tok, optim=OptimConfig(), max_steps=1,
        checkpoint_dir=Path(tempfile.mkdtemp()), pack_length=None, num_threads=threads,
        collate_fn=lambda ex: collate_rl(ex, pad_id=pad),
    )  # fmt: skip

    def through_backend(examples) -> None:
        async def step() -> None:
            await backend.forward_backward(examples, loss_fn=rl_loss_fn(grpo()),
                                           loss_weight_fn=loss_weight_fn(grpo())).result()  # fmt: skip
            await backend.call(lambda: backend.model.zero_grad(set_to_none=True)).result()

        trio.run(step)

    arms = {"shared_prompt": lambda: through_backend(shared),
            "backend_per_sample": lambda: through_backend(per_sample), "per_sample": bare}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in arms}
    with backend:
        for _ in range(args.reps + 1):  # the first round warms up
            for name, run in arms.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    slots = {"shared_prompt": b_slots, "backend_per_sample": a_slots, "per_sample": a_slots}
    return {"times": {k: statistics.median(v[1:]) for k, v in times.items()}, "slots": slots,
            **checks}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-response", type=int, default=5, help="tokens, EOS included")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 thread, 3 repetitions")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        harness.emit(measure(args.one, args))
        return 0
    if args.quick:
        harness.apply_quick(args, p, threads="1", reps=3)
    started = time.time()
    rows, notes = [], []
    for threads in map(int, args.threads.split(",")):
        out = harness.run_child([__file__, f"--one={threads}", f"--prompts={args.prompts}",
                                 f"--group={args.group}", f"--max-response={args.max_response}",
                                 f"--reps={args.reps}"])  # fmt: skip
        t = out["times"]
        for name in ("shared_prompt", "backend_per_sample", "per_sample"):
            slots = out["slots"][name]
            rows.append([threads, name, slots, t[name] * 1000, t["backend_per_sample"] / t[name]])
        notes.append(f"- {threads} thread(s): the backend's update with shared prompts is "
                     f"{t['backend_per_sample'] / t['shared_prompt']:.2f}x faster than with one row "
                     f"per sample, which costs {t['backend_per_sample'] / t['per_sample']:.2f}x the "
                     f"bare per-sample compute; same logprobs (max |diff| "
                     f"{out['logprob_max_abs_diff']:.1e}) and gradients (max relative diff "
                     f"{out['grad_max_rel_diff']:.1e})")  # fmt: skip
    table = harness.md_table(["threads", "layout", "token slots", "fwd+bwd ms",
                              "speed vs backend per-sample"], rows)  # fmt: skip
    head = (f"One GRPO batch of rl_tiny's shape: {args.prompts} prompts x {args.group} samples, "
            f"responses of 2-{args.max_response} tokens (EOS included), tiny model; median of "
            f"{args.reps} alternating repetitions.")  # fmt: skip
    harness.publish("grpo_update", "GRPO update: where the time goes, and shared prompts",
                    "GRPO update", [head, table], notes, quick=args.quick, started=started)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
