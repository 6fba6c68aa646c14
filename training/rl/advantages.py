"""Advantage estimators: per-sequence advantages from a [groups, samples] reward matrix.

Every estimator maps `rewards_GN` (float tensor, G prompts × N samples each, group-major like
`RolloutBatch.samples`) to advantages of the same shape; flatten with `.reshape(-1)` to get
`advantages_B` in sample order. They are pure, differentiable-free (inputs are rewards) and
never look at tokens: the advantage of a sequence is broadcast over its tokens by the loss.
Groups of unequal size (an agent session's branches are extra samples of its group) come
padded to [G, max N] with `mask_GN` (True on real samples): every statistic is taken over a
group's real samples only, and padding gets advantage 0. The `AdvantageFn` extension point
sees full groups only.

A group whose rewards are all equal carries no signal and gets advantage exactly 0 from every
estimator with a group baseline (float rounding of its mean would otherwise leave ~1e-7,
which division by a ~0 std turns into advantages of 0.1 or more); the batch-baseline
estimators give exactly 0 when the whole batch scored the same. "Equal" is up to float noise:
a population std of at most `NO_SPREAD_STD` (1e-6, the tolerance of DAPO's group filter,
`rollouts.groups.keep_if_reward_varies`), so a spread of 1e-7 is no signal rather than an
advantage of O(0.1), and the filter drops exactly the groups that would train nothing.

`AdvantageFn` is the extension point: any `(rewards_GN) -> advantages_GN` function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch

from plumbing.errors import ConfigError

AdvantageFn: TypeAlias = Callable[[torch.Tensor], torch.Tensor]

NO_SPREAD_STD = 1e-6  # rewards whose population std is at most this carry no signal


def _check(rewards_GN: torch.Tensor, estimator: str, *, min_n: int = 1,
           mask_GN: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    if rewards_GN.dim() != 2:
        raise ValueError(
            f"{estimator}: rewards must be [groups, samples_per_group], got shape "
            f"{tuple(rewards_GN.shape)}"
        )
    if mask_GN is not None and mask_GN.shape != rewards_GN.shape:
        raise ValueError(f"{estimator}: mask_GN has shape {tuple(mask_GN.shape)} for rewards "
                         f"of shape {tuple(rewards_GN.shape)}; give one flag per reward")  # fmt: skip
    if mask_GN is None:
        n = rewards_GN.shape[1]
    else:
        n = int(mask_GN.sum(dim=1).min()) if mask_GN.numel() else 0
    if n < min_n:
        raise ConfigError(
            f"{estimator} needs at least {min_n} samples per prompt, got {n}; "
            "raise n_samples_per_prompt"
        )
    return rewards_GN.float() if not rewards_GN.is_floating_point() else rewards_GN


def _mean(x_GN: torch.Tensor, mask_GN: torch.Tensor | None) -> torch.Tensor:
    """Each group's mean over its real samples ([G, 1])."""
    if mask_GN is None:
        return x_GN.mean(dim=1, keepdim=True)
    return (x_GN * mask_GN).sum(dim=1, keepdim=True) / mask_GN.sum(dim=1, keepdim=True)


def _std(x_GN: torch.Tensor, mask_GN: torch.Tensor | None) -> torch.Tensor:
    """Each group's unbiased (n-1) std over its real samples ([G, 1])."""
    if mask_GN is None:
        return x_GN.std(dim=1, keepdim=True)
    n_G1 = mask_GN.sum(dim=1, keepdim=True)
    return (((x_GN - _mean(x_GN, mask_GN)) * mask_GN).square().sum(dim=1, keepdim=True)
            / (n_G1 - 1)).sqrt()  # fmt: skip


def _zero_padding(advantages_GN: torch.Tensor, mask_GN: torch.Tensor | None) -> torch.Tensor:
    return advantages_GN if mask_GN is None else torch.where(mask_GN, advantages_GN, 0.0)


def _zero_equal_groups(advantages_GN: torch.Tensor, rewards_GN: torch.Tensor,
                       mask_GN: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """0 (exactly) for every group whose rewards are equal up to float noise (and on
    padding); the rest unchanged."""
    r_GN = rewards_GN.double()
    centred_GN = _zero_padding(r_GN - _mean(r_GN, mask_GN), mask_GN)
    n_G = rewards_GN.shape[1] if mask_GN is None else mask_GN.sum(dim=1)
    equal_G = (centred_GN.square().sum(dim=1) / n_G).sqrt() <= NO_SPREAD_STD
    return _zero_padding(torch.where(equal_G[:, None], 0.0, advantages_GN), mask_GN)


def _zero_if_all_equal(advantages_GN: torch.Tensor, rewards_GN: torch.Tensor,
                       mask_GN: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """0 (exactly) everywhere when the whole batch scored the same up to float noise (and on
    padding)."""
    real = (rewards_GN if mask_GN is None else rewards_GN[mask_GN]).double()
    if real.numel() and real.std(correction=0) <= NO_SPREAD_STD:
        return torch.zeros_like(advantages_GN)
    return _zero_padding(advantages_GN, mask_GN)


def grpo_advantages(
    rewards_GN: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    mask_GN: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath §4.1.2): (r - group mean) / (group std + eps).

    Uses the unbiased (n-1) std, like TRL and verl. A group whose rewards are all equal, up
    to float noise (`NO_SPREAD_STD`), gets zero advantages (no signal), not a division by
    (nearly) zero. `scale_by_std=False` gives the
    mean-centred form; the std scaling is what Dr.GRPO identifies as a difficulty bias.

    Args:
        rewards_GN: [G, N] rewards, N >= 2 when scaling by std.
        scale_by_std: divide by the group std.
        eps: added to the std.
        mask_GN: True on real samples of groups of unequal size (module docstring).

    Returns:
        [G, N] advantages.

    Raises:
        ConfigError: N < 2 with `scale_by_std` (the std is undefined).
    """
    rewards_GN = _check(rewards_GN, "grpo", min_n=2 if scale_by_std else 1, mask_GN=mask_GN)
    centred_GN = rewards_GN - _mean(rewards_GN, mask_GN)
    if scale_by_std:
        centred_GN = centred_GN / (_std(rewards_GN, mask_GN) + eps)
    return _zero_equal_groups(centred_GN, rewards_GN, mask_GN)


def dr_grpo_advantages(rewards_GN: torch.Tensor, *, mask_GN: torch.Tensor | None = None
                       ) -> torch.Tensor:  # fmt: skip
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): r - group mean.

    No std division. The other half of Dr.GRPO, summing token losses and dividing by a
    constant instead of the response length, is the "seq-mean-token-sum-norm" aggregation in
    `training.rl.losses.aggregate_loss`.
    """
    rewards_GN = _check(rewards_GN, "dr_grpo", mask_GN=mask_GN)
    return _zero_equal_groups(rewards_GN - _mean(rewards_GN, mask_GN), rewards_GN, mask_GN)


def rloo_advantages(rewards_GN: torch.Tensor, *, mask_GN: torch.Tensor | None = None
                    ) -> torch.Tensor:  # fmt: skip
    """RLOO (Ahmadian et al. 2024, "Back to Basics"): r_i - mean of the other N-1 rewards.

    Computed as N/(N-1) * (r_i - group mean), which is the same quantity.

    Raises:
        ConfigError: N < 2 (no other samples to form the baseline).
    """
    rewards_GN = _check(rewards_GN, "rloo", min_n=2, mask_GN=mask_GN)
    n = rewards_GN.shape[1] if mask_GN is None else mask_GN.sum(dim=1, keepdim=True)
    advantages_GN = (rewards_GN - _mean(rewards_GN, mask_GN)) * (n / (n - 1))
    return _zero_equal_groups(advantages_GN, rewards_GN, mask_GN)


def reinforce_pp_advantages(
    rewards_GN: torch.Tensor,
    *,
    group_baseline: bool = True,
    token_weights_GN: torch.Tensor | None = None,
    eps: float = 1e-6,
    mask_GN: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): optional group-mean baseline, then whitening over the batch.

    `group_baseline=True` is the paper's "REINFORCE++-baseline" (subtract each prompt's mean
    reward first, which is what makes it robust to reward scale across prompts);
    `group_baseline=False` is plain REINFORCE++. Either way the result is normalised by the
    mean and std of the whole batch, not of each group.

    Whitening: with `token_weights_GN` (each sample's trained-token count) the mean and std
    are taken over tokens, as in the paper and verl (every token of a sequence carries its
    advantage, so a long sequence weighs more); without, over sequences (each weighs the same).

    Departures: the paper's per-token returns include a token-level KL penalty; here KL is a
    loss or a per-sequence reward penalty (training.rl.losses), so the return is the same on
    every token of a sequence and token whitening is length-weighted whitening.

    Raises:
        ConfigError: fewer than 2 samples (or trained tokens) in the batch: no batch std.
    """
    rewards_GN = _check(rewards_GN, "reinforce_pp", mask_GN=mask_GN)
    adv_GN = rewards_GN - _mean(rewards_GN, mask_GN) if group_baseline else rewards_GN
    w_GN = torch.ones_like(adv_GN) if token_weights_GN is None else token_weights_GN.to(adv_GN)
    if mask_GN is not None:
        w_GN = w_GN * mask_GN
    n = w_GN.sum()
    if n < 2:
        raise ConfigError("reinforce_pp needs at least 2 samples (tokens) per batch to normalise")
    mean = (w_GN * adv_GN).sum() / n
    std = ((w_GN * (adv_GN - mean).square()).sum() / (n - 1)).sqrt()
    whitened_GN = (adv_GN - mean) / (std + eps)
    if group_baseline:  # centred groups: the batch mean is 0 up to rounding
        return _zero_equal_groups(whitened_GN, rewards_GN, mask_GN)
    return _zero_if_all_equal(whitened_GN, rewards_GN, mask_GN)


def reinforce_baseline_advantages(rewards_GN: torch.Tensor, *,
                                  mask_GN: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """REINFORCE with a batch-mean baseline (Williams 1992): r - mean of all rewards.

    Ignores the group structure, so prompts of different difficulty share one baseline; use
    it as the simplest reference point, GRPO/RLOO in practice.
    """
    rewards_GN = _check(rewards_GN, "reinforce_baseline", mask_GN=mask_GN)
    mean = rewards_GN.mean() if mask_GN is None else rewards_GN[mask_GN].mean()
    return _zero_if_all_equal(rewards_GN - mean, rewards_GN, mask_GN)
