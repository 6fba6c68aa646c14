"""Generated batch shapes for the world-size property test (tests/test_distributed_shapes.py).

A case is a JSON-able dict that fixes one backend and one batch: SFT (packed) or RL (groups of
samples sharing a prompt, with or without prefix sharing), the loss aggregation and policy
loss, LoRA on or off, the micro-batch token budget, and every token id. Each case comes from
one seed (`case_from_seed`), named `seed<N>`, so a failure names the case that reproduces it.

The coverage dimensions cycle with the seed (aggregation, loss, LoRA, prompt sharing, SFT every
fifth case, the padding-free `segments` attention in three cases of four), so that even a handful of consecutive seeds covers each of them; lengths, group
counts, rewards, token ids and the budget are drawn from the seed. Budgets are drawn between
the widest row and the whole batch, so that most cases split into several micro-batches, and
the ranks' shares of them are often unequal.

Why not `hypothesis`: every case runs in one torchrun launch per world size (a launch costs
~10 s), so cases are generated up front, not one at a time; shrinking would need a launch per
step. A seeded generator with named seeds gives the same reproducibility.
"""

from __future__ import annotations

import random
from typing import Any

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")  # fmt: skip
LOSSES = ("ppo_clip", "gspo", "cispo", "pg")
VOCAB = (3, 360)  # token ids drawn from here (the tiny model has 371)
MAX_TOKENS_NORM = 16  # seq-mean-token-sum-norm's constant (a generation budget)

# The batch of issue 24: 5 groups x 4 samples sharing prompts, budget 40 → micro-batches [2, 3]
# at world 2 (FSDP deadlocked on the rank with more micro-batches before the fix).
ISSUE_24 = {
    "name": "issue24",
    "seed": -1,
    "kind": "rl",
    "lora": False,
    "micro_batch_tokens": 40,
    "share_prompts": True,
    "aggregation": "token-mean",
    "loss": "ppo_clip",
    "groups": [
        {"prompt": [5, 6, 8 + g],
         "responses": [[7 + (i + k + g) % 11 for k in range(3 + (g * 5 + i * 3) % 7)]
                       for i in range(4)],
         "masks": [[1] * (3 + (g * 5 + i * 3) % 7) for i in range(4)],
         "rewards": [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2], [0.3, 0.9, 0.0, 1.0],
                     [0.1, 0.6, 0.6, 0.9], [1.0, 0.4, 0.0, 0.7]][g]}
        for g in range(5)
    ],
}  # fmt: skip


def _ids(r: random.Random, n: int) -> list[int]:
    return [r.randrange(*VOCAB) for _ in range(n)]


def case_from_seed(seed: int) -> dict[str, Any]:
    """One case; the coverage dimensions cycle with `seed`, the rest is drawn from it."""
    r = random.Random(seed)
    lora = seed % 3 == 1
    attention = "sdpa" if seed % 4 == 3 else "segments"
    if seed % 5 == 4:
        pack_length = r.choice((32, 48, 64))
        samples = []
        for _ in range(r.randint(1, 14)):
            n_prompt = r.randint(1, pack_length // 2)
            n_answer = r.randint(1, pack_length - n_prompt)
            samples.append({"ids": _ids(r, n_prompt + n_answer),
                            "mask": [0] * n_prompt + [1] * n_answer})  # fmt: skip
        return {"name": f"seed{seed}", "seed": seed, "kind": "sft", "lora": lora,
                "attention": attention, "pack_length": pack_length,
                "micro_batch_tokens": pack_length * r.randint(1, 3),
                "samples": samples}  # fmt: skip
    groups = []
    size = r.randint(2, 5)  # samples per prompt (the same for every group, as in a batch)
    for _ in range(r.randint(1, 6)):
        lengths = [r.randint(1, 14) for _ in range(size)]
        masks = [[int(r.random() > 0.15) for _ in range(n)] for n in lengths]
        for mask in masks:
            mask[r.randrange(len(mask))] = 1  # at least one trained token
        rewards = [round(r.random(), 1) for _ in range(size)]
        rewards[0], rewards[-1] = 0.0, 1.0  # a reward spread: non-zero advantages
        groups.append({"prompt": _ids(r, r.randint(2, 10)),
                       "responses": [_ids(r, n) for n in lengths], "masks": masks,
                       "rewards": rewards})  # fmt: skip
    widest = max(len(g["prompt"]) + max(map(len, g["responses"])) for g in groups)
    total = sum(len(g["prompt"]) + len(x) for g in groups for x in g["responses"])
    return {"name": f"seed{seed}", "seed": seed, "kind": "rl", "lora": lora,
            "attention": attention, "micro_batch_tokens": r.randint(widest, max(widest, total // 2)),
            "share_prompts": seed % 2 == 0, "aggregation": AGGREGATIONS[seed % 4],
            "loss": LOSSES[(seed // 4) % 4], "groups": groups}  # fmt: skip


def cases(seeds: range) -> list[dict[str, Any]]:
    return [case_from_seed(s) for s in seeds]


# The engine/trainer mismatch corrections (training/rl/mismatch.py) at any world size: GRPO's
# clipped loss per sequence, the engine's logprobs = the trainer's + `engine_offsets` (a known
# ratio e^-offset per token), one case per correction; tests/test_mismatch_correction.py writes
# each paper's gradient out and compares.
MISMATCH_KINDS = ("tis", "mis", "icepop", "seq_tis", "seq_mis")
_OFFSETS = (0.0, 0.5, -0.3, 1.2, -0.9, 0.1, 2.0, -1.8)


def engine_offsets(j: int, n: int) -> list[float]:
    """Engine − trainer logprobs of row j's n trained tokens: every third row agrees exactly,
    every third the engine is less sure by about a nat (ρ > 2: truncated at sequence level)."""
    if j % 3 == 0:
        return [0.0] * n
    return [_OFFSETS[(3 * j + k) % 8] - (j % 3 == 2) for k in range(n)]


def mismatch_cases() -> list[dict[str, Any]]:
    """One RL case per correction (seeds 0..4's batches, full fine-tuning, sdpa or segments)."""
    out = []
    for seed, kind in zip((0, 1, 2, 3, 5), MISMATCH_KINDS, strict=True):
        case = case_from_seed(seed)
        masks = [mask for g in case["groups"] for mask in g["masks"]]  # rows in sample order
        offsets = [engine_offsets(j, sum(mask)) for j, mask in enumerate(masks)]
        out.append(case | {"name": f"mismatch_{kind}", "mismatch": kind, "lora": False,
                           "loss": "ppo_clip", "aggregation": "seq-mean-token-mean",
                           "engine_offsets": offsets})  # fmt: skip
    return out


# Held-out greedy decoding (issue 24, item 5): 7 prompts of different lengths in batches of 2,
# split across ranks (world 3: batches [1, 1, 2], so two ranks decode an idle batch).
GREEDY = {
    "name": "greedy",
    "seed": -2,
    "kind": "greedy",
    "lora": False,
    "micro_batch_tokens": 64,
    "batch_size": 2,
    "prompts": [_ids(random.Random(7 + n), 2 + 3 * n % 11) for n in range(7)],
}
