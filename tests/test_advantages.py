"""Advantage estimators against hand-computed values on toy reward matrices."""

from __future__ import annotations

import math

import pytest
import torch

from rollouts.errors import ConfigError
from training.rl.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_baseline_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

# Group 0: one success in four (mean 0.25, unbiased std 0.5); group 1: all equal.
REWARDS_GN = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])


def close(actual: torch.Tensor, expected) -> bool:
    return torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-5)


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    assert close(grpo_advantages(REWARDS_GN), [[1.5, -0.5, -0.5, -0.5], [0.0, 0.0, 0.0, 0.0]])


def test_grpo_zero_std_group_gets_zero_not_nan():
    out = grpo_advantages(torch.ones(3, 4))
    assert torch.equal(out, torch.zeros(3, 4))


def test_grpo_without_std_scaling_is_mean_centred():
    expected = [[0.75, -0.25, -0.25, -0.25], [0.0] * 4]
    assert close(grpo_advantages(REWARDS_GN, scale_by_std=False), expected)


def test_dr_grpo_is_mean_centred_without_std():
    assert close(dr_grpo_advantages(REWARDS_GN), [[0.75, -0.25, -0.25, -0.25], [0.0] * 4])
    # Scaling rewards scales Dr.GRPO advantages (no std normalisation) but not GRPO's.
    assert close(dr_grpo_advantages(3 * REWARDS_GN), [[2.25, -0.75, -0.75, -0.75], [0.0] * 4])
    assert close(grpo_advantages(3 * REWARDS_GN), grpo_advantages(REWARDS_GN).tolist())


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # Sample 0: 1 - mean(0, 0, 0) = 1; others: 0 - mean(1, 0, 0) = -1/3.
    assert close(rloo_advantages(REWARDS_GN), [[1.0, -1 / 3, -1 / 3, -1 / 3], [0.0] * 4])


def test_reinforce_pp_baseline_whitens_over_the_batch_not_the_group():
    rewards_GN = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 1.0, 1.0, 1.0]])
    # Group-centred: [.75, -.25, -.25, -.25] and [1.5, -.5, -.5, -.5]; batch mean 0,
    # sum of squares 0.75 + 3.0 = 3.75, unbiased batch std sqrt(3.75 / 7).
    std = math.sqrt(3.75 / 7)
    expected = [[0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std],
                [1.5 / std, -0.5 / std, -0.5 / std, -0.5 / std]]  # fmt: skip
    assert close(reinforce_pp_advantages(rewards_GN), expected)


def test_reinforce_pp_without_group_baseline_whitens_raw_rewards():
    rewards_GN = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    # Batch mean 1 → [0, -1, 2, -1]; unbiased std sqrt(6 / 3) = sqrt(2).
    s = math.sqrt(2)
    expected = [[0.0, -1 / s], [2 / s, -1 / s]]
    assert close(reinforce_pp_advantages(rewards_GN, group_baseline=False), expected)


def test_reinforce_baseline_subtracts_the_batch_mean():
    assert close(reinforce_baseline_advantages(torch.tensor([[1, 0], [3, 0]])), [[0, -1], [2, -1]])


@pytest.mark.parametrize(
    "fn",
    [
        grpo_advantages,
        dr_grpo_advantages,
        rloo_advantages,
        reinforce_pp_advantages,
        reinforce_baseline_advantages,
    ],
)
def test_estimators_keep_shape_and_accept_integer_rewards(fn):
    out = fn(torch.tensor([[1, 0, 0], [0, 1, 1]]))
    assert out.shape == (2, 3) and out.dtype == torch.float32


def test_bad_shapes_are_explained():
    with pytest.raises(ValueError, match=r"\[groups, samples_per_group\]"):
        grpo_advantages(torch.ones(4))
    with pytest.raises(ConfigError, match="at least 2 samples per prompt"):
        grpo_advantages(torch.ones(4, 1))
    with pytest.raises(ConfigError, match="rloo"):
        rloo_advantages(torch.ones(4, 1))
    assert torch.equal(dr_grpo_advantages(torch.ones(4, 1)), torch.zeros(4, 1))


# Groups of 5, 2 and 3 samples (an agent session's branches are extra samples of its group),
# padded to 5 with a mask.
RAGGED = [[1.0, 0.0, 0.0, 0.0, 1.0], [1.0, 0.0], [1.0, 1.0, 1.0]]


def padded(groups, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, groups))
    rewards = torch.tensor([g + [fill] * (width - len(g)) for g in groups])
    return rewards, torch.tensor([[i < len(g) for i in range(width)] for g in groups])


def real(advantages_GN: torch.Tensor, groups) -> list[list[float]]:
    return [advantages_GN[g, : len(group)].tolist() for g, group in enumerate(groups)]


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages,
                                reinforce_pp_advantages, reinforce_baseline_advantages])  # fmt: skip
def test_unequal_groups_ignore_their_padding_and_pad_with_zero_advantage(fn):
    rewards, mask = padded(RAGGED, 0.0)
    out = fn(rewards, mask_GN=mask)
    assert torch.equal(out, fn(padded(RAGGED, 7.0)[0], mask_GN=mask))
    assert torch.all(out[~mask] == 0.0) and torch.isfinite(out).all()


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_unequal_groups_get_each_groups_own_statistics(fn):
    rewards, mask = padded(RAGGED, 0.0)
    want = [fn(torch.tensor([g]))[0].tolist() for g in RAGGED]
    for got, expected in zip(real(fn(rewards, mask_GN=mask), RAGGED), want, strict=True):
        assert got == pytest.approx(expected, abs=1e-6)


def test_unequal_groups_share_one_batch_baseline_over_real_samples_only():
    rewards, mask = padded(RAGGED, 0.0)
    flat = torch.tensor([[r for g in RAGGED for r in g]])
    for fn in (reinforce_baseline_advantages,
               lambda r, **kw: reinforce_pp_advantages(r, group_baseline=False, **kw)):  # fmt: skip
        got = [a for row in real(fn(rewards, mask_GN=mask), RAGGED) for a in row]
        assert got == pytest.approx(fn(flat)[0].tolist(), abs=1e-6)
