"""Online DPO's pair selector: the default picks the pairs the fixed rule did, and a custom
selector's pairs are the ones the backend trains on."""

import random

import pytest
import torch

from rollouts.types import RolloutBatch, Sample
from training.rl.algorithms import online_dpo
from training.rl.batch import build_examples, collate_rl
from training.rl.preference_loss import best_vs_worst


def sample(response, reward, g, i):
    return Sample((5, 6, g), tuple(response), (1,) * len(response), (-1.0,) * len(response),
                  reward=reward, group_id=g, index_in_group=i)  # fmt: skip


def fixed_best_vs_worst_pairs(batch):
    """The rule before the selector existed (training/rl/batch.py at 8286a85), as sources."""
    pairs = []
    for group in batch.groups:
        usable = [s for s in group if s.num_trained_tokens]
        if len(usable) < 2:
            continue
        best = max(usable, key=lambda s: s.reward)
        worst = min(usable, key=lambda s: s.reward)
        if best.reward > worst.reward:
            pairs.append((best, worst))
    return [(f"group {b.group_id} sample {b.index_in_group}",
             f"group {w.group_id} sample {w.index_in_group}") for b, w in pairs]  # fmt: skip


def test_default_selector_gives_the_fixed_rules_pairs_on_random_groups():
    rng = random.Random(0)
    for _ in range(200):
        groups = tuple(
            tuple(
                sample([7] * rng.choice([0, 1, 2]), float(rng.choice([0, 0.5, 1])), g, i)
                for i in range(rng.randint(1, 5))
            )
            for g in range(rng.randint(1, 4))
        )
        batch = RolloutBatch(groups, 1, 0)
        examples = build_examples(batch, online_dpo())
        got = [(a.source, b.source) for a, b in zip(examples[::2], examples[1::2], strict=True)]
        assert got == fixed_best_vs_worst_pairs(batch)
        assert [e.advantage for e in examples] == [1.0, -1.0] * len(got)
        assert build_examples(batch, online_dpo(), pair_selector=best_vs_worst) == examples


async def test_a_custom_selectors_pairs_are_the_ones_trained(tiny_model_dir, tmp_path):
    from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
    from training.config import OptimConfig
    from training.rl.reference import make_reference
    from training.rl.step import train_on_batch

    def lowest_first(rewards_N, samples_N):  # prefers the *lower* reward: the reverse of default
        order = sorted(range(len(rewards_N)), key=lambda i: rewards_N[i])
        return [(order[0], order[-1])]

    batch = RolloutBatch(((sample([7, 8], 1.0, 0, 0), sample([9, 10], 0.0, 0, 1)),), 1, 0)
    examples = build_examples(batch, online_dpo(), pair_selector=lowest_first)
    assert [e.source for e in examples] == ["group 0 sample 1", "group 0 sample 0"]

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    backend = PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=1e-2), max_steps=3, checkpoint_dir=tmp_path,
        pack_length=None, collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip
    with backend, make_reference(backend) as reference:
        for _ in range(3):
            metrics = await train_on_batch(backend, batch, online_dpo(dpo_beta=1.0),
                                           temperature=1.0, old_from_rollout=False,
                                           reference=reference, pair_selector=lowest_first)  # fmt: skip
        assert metrics["num_pairs"] == 1.0
        now = [lp.sum() for lp in await backend.compute_logprobs(examples).result()]
        ref = [lp.sum() for lp in await reference.compute_logprobs(examples).result()]
    implicit = [float(a - b) for a, b in zip(now, ref, strict=True)]
    # The selector's chosen sample (reward 0) gained on the reference relative to its rejected.
    assert implicit[0] - implicit[1] > 0.1
    assert torch.tensor(implicit).isfinite().all()
    assert metrics["preference_accuracy"] == pytest.approx(1.0)
