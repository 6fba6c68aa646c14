"""Where a GRPO update's time goes, and what sharing each group's prompt would save (what-if).

The GRPO step of rl_tiny is dominated by the update (forward + backward over B x G sequences
of prompt + response), and the update is compute-bound. On one batch of that shape (real
arithmetic prompts through the chat template, responses of 2..`--max-response` tokens) this
times forward + backward of the same GRPO loss three ways, alternating, in one process:
- backend: `PyTorchTrainingBackend.forward_backward` with the RL loss (what the loop runs:
  collate, one row per sample, worker thread);
- per_sample: the same layout inline (one row per sample, right-padded): the bare compute;
- shared_prompt: one row per group, [prompt, response 1, ..., response G], with a tree
  attention mask (each response sees the prompt and itself) and position ids that restart
  after the prompt, so every response token's logprob is that of the per-sample layout; the
  first token of each response is scored from the prompt's last position.
It checks that shared_prompt gives the same logprobs and gradients (float tolerance) and
reports the speed-up. shared_prompt is not in the library yet: this measures what it would buy.

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

import rollouts.threads  # noqa: F401  (before torch: the project's OpenMP settings)


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

    from training.packing import token_logprobs

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


def shared_prompt_logprobs(model, groups, pad: int):
    """One row per group with a tree mask; the same [S, L] logprobs as per_sample."""
    import torch

    width = max(len(p) + sum(map(len, rs)) for p, rs in groups)
    longest = max(len(r) for _, rs in groups for r in rs)
    n_samples = sum(len(rs) for _, rs in groups)
    ids = torch.full((len(groups), width), pad)
    pos = torch.zeros((len(groups), width), dtype=torch.long)
    attend = torch.zeros((len(groups), 1, width, width), dtype=torch.bool)
    src = torch.zeros((n_samples, longest), dtype=torch.long)  # flat position scoring each token
    tgt = torch.zeros((n_samples, longest), dtype=torch.long)
    mask = torch.zeros(n_samples, longest)
    s = 0
    for g, (p, rs) in enumerate(groups):
        n = len(p)
        ids[g, :n], pos[g, :n] = torch.tensor(p), torch.arange(n)
        attend[g, 0, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        off = n
        for r in rs:
            k = len(r)
            ids[g, off : off + k], pos[g, off : off + k] = torch.tensor(r), torch.arange(n, n + k)
            attend[g, 0, off : off + k, :n] = True
            attend[g, 0, off : off + k, off : off + k] = torch.ones(k, k, dtype=torch.bool).tril()
            src[s, :k] = torch.tensor(
                [g * width + n - 1] + [g * width + off + j for j in range(k - 1)]
            )
            tgt[s, :k], mask[s, :k] = torch.tensor(r), 1
            off, s = off + k, s + 1
        for t in range(off, width):  # padding attends to itself: finite softmax, no effect
            attend[g, 0, t, t] = True
    logits = model(input_ids=ids, position_ids=pos, attention_mask=attend, use_cache=False).logits
    picked = logits.reshape(-1, logits.shape[-1])[src]  # [S, L, V]
    lp = picked.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - picked.logsumexp(-1)
    return lp * mask, mask, ids.numel()


def grpo_loss(lp, mask, adv):
    """GRPO with one update per batch: ratio 1 (old = detached), per-sequence token mean."""
    import torch

    ratio = torch.exp(lp - lp.detach())
    return -((ratio * adv[:, None] * mask).sum(1) / mask.sum(1)).mean()


def measure(threads: int, args) -> dict:
    import torch
    import trio

    from rollouts.types import RolloutBatch, Sample
    from training.algorithms import grpo
    from training.backend import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.config import OptimConfig
    from training.rl_batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn
    from training.tiny_model import build_tiny_model

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
    examples = build_examples(batch, grpo())
    adv = torch.tensor([e.advantage for e in examples])

    def run(layout) -> tuple:
        model.zero_grad(set_to_none=True)
        lp, mask, slots = layout(model, groups, pad)
        grpo_loss(lp, mask, adv).backward()
        return lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}, slots

    a_lp, a_grad, a_slots = run(per_sample_logprobs)
    b_lp, b_grad, b_slots = run(shared_prompt_logprobs)
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

    async def through_backend() -> None:
        await backend.forward_backward(examples, loss_fn=rl_loss_fn(grpo()),
                                       loss_weight_fn=loss_weight_fn(grpo())).result()  # fmt: skip
        await backend.call(lambda: backend.model.zero_grad(set_to_none=True)).result()

    times: dict[str, list[float]] = {"backend": [], "per_sample": [], "shared_prompt": []}
    with backend:
        for _ in range(args.reps + 1):  # the first round warms up
            for name in times:
                t0 = time.perf_counter()
                if name == "backend":
                    trio.run(through_backend)
                else:
                    run(per_sample_logprobs if name == "per_sample" else shared_prompt_logprobs)
                times[name].append(time.perf_counter() - t0)
    return {"times": {k: statistics.median(v[1:]) for k, v in times.items()},
            "slots": {"per_sample": a_slots, "shared_prompt": b_slots}, **checks}  # fmt: skip


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
        for name in ("backend", "per_sample", "shared_prompt"):
            slots = out["slots"].get(name, out["slots"]["per_sample"])
            rows.append([threads, name, slots, t[name] * 1000, t["per_sample"] / t[name]])
        notes.append(f"- {threads} thread(s): shared prompt {t['per_sample'] / t['shared_prompt']:.2f}x "
                     f"faster than one row per sample; the backend's update costs "
                     f"{t['backend'] / t['per_sample']:.2f}x the bare per-sample compute; same "
                     f"logprobs (max |diff| {out['logprob_max_abs_diff']:.1e}) and gradients "
                     f"(max relative diff {out['grad_max_rel_diff']:.1e})")  # fmt: skip
    table = harness.md_table(["threads", "layout", "token slots", "fwd+bwd ms", "speed vs per-sample"],
                             rows)  # fmt: skip
    head = (f"One GRPO batch of rl_tiny's shape: {args.prompts} prompts x {args.group} samples, "
            f"responses of 2-{args.max_response} tokens (EOS included), tiny model; median of "
            f"{args.reps} alternating repetitions.")  # fmt: skip
    print(f"\nGRPO update\n{head}\n{table}\n" + "\n".join(notes))
    harness.write_section("grpo_update", "GRPO update: where the time goes, and a shared-prompt what-if",
                          f"{head}\n\n{table}\n\n" + "\n".join(notes), quick=args.quick,
                          started=started)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
