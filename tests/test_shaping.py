"""Reward shaping: length and entropy terms as sample transforms, and the trainer-side KL
penalty (k1 against reference logprobs of the same tokens), checked against hand-computed
values; each shaped part is kept as a named reward component."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rollouts.errors import DataError
from rollouts.generation import apply_sample_transforms
from rollouts.rewards import length_penalty
from rollouts.shaping import add_reward_component, add_shaping, entropy_bonus, length_bonus
from rollouts.types import RolloutBatch, Sample
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.loops.rl import train_on_batch
from training.rl.algorithms import grpo
from training.rl.batch import build_examples, collate_rl, kl_penalised_batch, sample_to_example


def sample(mask, logprobs=(), reward=1.0, components=None, g=0, i=0) -> Sample:
    n = len(mask)
    return Sample((1, 2), tuple(range(10, 10 + n)), tuple(mask), tuple(logprobs),
                  group_id=g, index_in_group=i).with_reward(reward, components)  # fmt: skip


def test_add_reward_component_adds_to_the_total_and_keeps_the_parts():
    scalar = add_reward_component(sample([1]), "length", -0.25)
    assert scalar.reward == 0.75
    assert scalar.reward_components == {"task": 1.0, "length": -0.25}
    vector = sample([1], reward=1.5, components={"correct": 1.0, "format": 0.5})
    shaped = add_reward_component(vector, "entropy", 0.1)
    assert shaped.reward == pytest.approx(1.6)
    assert shaped.reward_components == {"correct": 1.0, "format": 0.5, "entropy": 0.1}
    with pytest.raises(ValueError, match="'format' already set"):
        add_reward_component(vector, "format", 1.0)


def test_length_bonus_counts_only_generated_tokens_and_can_be_capped():
    s = sample([1, 1, 0, 0, 1])  # 3 generated tokens, 2 tool tokens
    assert length_bonus(0.1)(s) == pytest.approx(0.3)
    assert length_bonus(-0.1)(s) == pytest.approx(-0.3)
    assert length_bonus(0.1, max_tokens=2)(s) == pytest.approx(0.2)


def test_entropy_bonus_is_the_mean_surprisal_of_generated_tokens():
    s = sample([1, 0, 1], logprobs=[math.log(0.5), 0.0, math.log(0.25)])
    expected = 0.2 * (math.log(2) + math.log(4)) / 2
    assert entropy_bonus(0.2)(s) == pytest.approx(expected)
    assert entropy_bonus(0.2)(sample([0, 0], logprobs=[0.0, 0.0])) == 0.0
    with pytest.raises(DataError, match="no rollout logprobs"):
        entropy_bonus(0.2)(sample([1]))


def test_shaping_transforms_compose_into_named_components():
    transforms = [
        add_shaping("length", length_bonus(-0.1)),
        add_shaping("overlong", length_penalty(max_tokens=1, coef=0.5)),
        add_shaping("entropy", entropy_bonus(1.0)),
    ]
    s = sample([1, 1], logprobs=[math.log(0.5), math.log(0.5)], reward=1.0)
    (shaped,) = apply_sample_transforms([s], transforms)
    assert shaped.reward_components == pytest.approx(
        {"task": 1.0, "length": -0.2, "overlong": -0.5, "entropy": math.log(2)}
    )
    assert shaped.reward == pytest.approx(sum(shaped.reward_components.values()))


def test_kl_penalty_subtracts_coef_times_summed_k1_before_advantages():
    groups = (
        (sample([1, 1], reward=1.0, g=0, i=0), sample([1, 0, 1], reward=0.0, g=0, i=1)),
        (sample([0], reward=0.5, g=1, i=0), sample([1], reward=0.5, g=1, i=1)),
    )
    batch = RolloutBatch(groups, step_id=1, epoch_id=0)
    logprobs_S = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -0.5]), torch.zeros(0),
                  torch.tensor([-3.0])]  # fmt: skip
    ref_S = [torch.tensor([-1.5, -1.0]), torch.tensor([-0.5, -1.5]), torch.zeros(0),
             torch.tensor([-1.0])]  # fmt: skip
    config = grpo(kl_coef=0.5, kl_kind="k1", kl_as_reward=True)
    shaped, metrics = kl_penalised_batch(batch, config, logprobs_S, ref_S)
    # k1 summed per sample: (0.5 - 1.0), (0 + 1.0), none, (-2.0)
    penalties = [0.5 * -0.5, 0.5 * 1.0, 0.0, 0.5 * -2.0]
    old = [1.0, 0.0, 0.5, 0.5]
    assert [s.reward for s in shaped.samples] == pytest.approx(
        [r - p for r, p in zip(old, penalties, strict=True)]
    )
    assert [s.reward_components["kl_penalty"] for s in shaped.samples] == pytest.approx(
        [-p for p in penalties]
    )
    assert shaped.samples[0].reward_components["task"] == 1.0
    assert metrics["kl"] == pytest.approx((-0.5 + 1.0 - 2.0) / 5)  # per trained token
    assert metrics["kl_reward_penalty_mean"] == pytest.approx(sum(penalties) / 4)
    # advantages now see the penalty: group 1 had equal rewards, now it has a spread
    assert build_examples(batch, config)[2].advantage == 0.0  # group 1, sample 1
    assert build_examples(shaped, config)[2].advantage > 0  # k1 < 0 there: reward 0.5 → 1.5


def test_kl_penalty_applies_per_sample_to_groups_of_unequal_size():
    """An agent session's other branches make a group larger than n; each sample is still
    penalised by its own KL (the penalty has no group structure)."""
    branch = replace(sample([1], reward=1.0), sub_index=1)  # session 0's other branch
    groups = (
        (sample([1], reward=1.0), branch, sample([1], reward=0.0, i=1)),
        (sample([1], reward=0.5, g=1),),
    )
    logprobs_S = [torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-3.0]),
                  torch.tensor([-4.0])]  # fmt: skip
    ref_S = [torch.tensor([-1.0])] * 4
    shaped, _ = kl_penalised_batch(RolloutBatch(groups, 1, 0), grpo(kl_coef=1.0, kl_kind="k1",
                                   kl_as_reward=True), logprobs_S, ref_S)  # fmt: skip
    assert [len(g) for g in shaped.groups] == [3, 1]
    assert [s.reward for s in shaped.samples] == pytest.approx([1.0, 2.0, 2.0, 3.5])


def test_kl_penalty_is_off_unless_kl_as_reward():
    batch = RolloutBatch(((sample([1]), sample([1], i=1)),), 1, 0)
    logprobs_S = [torch.tensor([-1.0]), torch.tensor([-1.0])]
    same, metrics = kl_penalised_batch(batch, grpo(kl_coef=0.5), logprobs_S, logprobs_S)
    assert same is batch and metrics == {}
    with pytest.raises(ValueError, match="one per sample"):
        kl_penalised_batch(batch, grpo(kl_coef=0.5, kl_as_reward=True), logprobs_S[:1], [])


async def test_kl_as_reward_uses_reference_logprobs_of_the_sampled_tokens(
    tiny_model_dir, tiny_model_dir_seed1, tmp_path
):
    def backend(model_dir, name):
        model, tok = load_model_and_tokenizer(model_dir)
        return PyTorchTrainingBackend(
            model, tok, optim=OptimConfig(lr=1e-3), max_steps=2, checkpoint_dir=tmp_path / name,
            pack_length=None, collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
        )  # fmt: skip

    def scored(g: int, i: int) -> Sample:
        s = Sample((5, 6, g), (7 + i, 9, 2), (1, 0, 1), group_id=g, index_in_group=i)
        return s.with_reward(float(i))

    batch = RolloutBatch(tuple((scored(g, 0), scored(g, 1)) for g in range(2)), 1, 0)
    config = grpo(kl_coef=0.05, kl_kind="k1", kl_as_reward=True)
    with backend(tiny_model_dir, "p") as policy, backend(tiny_model_dir_seed1, "r") as reference:
        examples = [sample_to_example(s, 0.0) for s in batch.samples]
        policy_lp = await policy.compute_logprobs(examples).result()
        ref_lp = await reference.compute_logprobs(examples).result()
        metrics = await train_on_batch(policy, batch, config, temperature=1.0,
                                       old_from_rollout=False, reference=reference)  # fmt: skip
    k1_S = [float((lp - ref).sum()) for lp, ref in zip(policy_lp, ref_lp, strict=True)]
    assert abs(sum(k1_S)) > 0.1  # different weights: a real penalty
    assert metrics["kl_reward_penalty_mean"] == pytest.approx(0.05 * sum(k1_S) / 4, rel=1e-4)
    assert metrics["kl"] == pytest.approx(sum(k1_S) / 8, rel=1e-4)  # 2 trained tokens each
    assert metrics["grad_norm"] > 0
