"""Online DPO: which pairs of a group to prefer, and the pairwise preference loss.

The loss is re-exported by training.rl.losses, which holds the conventions shared by every
loss: [B, T] logprobs of the sampled tokens, a trained-token mask. The pair selector is an
extension point (`RLObjective(pair_selector=...)`): the loss trains whatever pairs it returns,
chosen first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import torch
import torch.nn.functional as F

from rollouts.types import Sample
from training.rl.kl import bool_mask

LossOutput = tuple[torch.Tensor, dict[str, float]]

PairSelector: TypeAlias = Callable[[Sequence[float], Sequence[Sample]], list[tuple[int, int]]]
"""(rewards_N, samples_N) of one group -> [(chosen, rejected), ...] indices into them.

It sees only the group's samples that have trained tokens (the others carry no gradient). A
sample may be in several pairs; an empty list skips the group. Each pair is one DPO term.
"""


def best_vs_worst(rewards_N: Sequence[float], samples_N: Sequence[Sample]) -> list[tuple[int, int]]:
    """The default `PairSelector`: the highest- against the lowest-reward sample (first on
    ties), and no pair when they are equal (the group states no preference)."""
    if len(rewards_N) < 2:
        return []
    best = max(range(len(rewards_N)), key=lambda i: rewards_N[i])
    worst = min(range(len(rewards_N)), key=lambda i: rewards_N[i])
    return [(best, worst)] if rewards_N[best] > rewards_N[worst] else []


def pairwise_preference_loss(
    logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    rewards_GN: torch.Tensor,
    *,
    beta: float = 0.1,
) -> LossOutput:
    """Online DPO over the best and worst sample of each group.

    The DPO loss (Rafailov et al. 2023), −log σ(β [(log π_θ − log π_ref)(y_w) −
    (log π_θ − log π_ref)(y_l)]), on pairs built online from the policy's own samples (as in
    Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"): y_w / y_l are
    the highest / lowest-reward samples of a group (first index on ties). Groups whose best
    and worst rewards are equal carry no preference and are skipped. This is its own
    algorithm, not DAPO. Sequence logprobs sum over trained tokens only.

    Args:
        logprobs_BT: [G·N, T], rows group-major (row g·N + n is sample n of group g).
        ref_logprobs_BT: reference-model logprobs of the same tokens.
        mask_BT: trained-token mask.
        rewards_GN: [G, N] rewards, used only to pick the pairs.
        beta: DPO temperature.

    Returns:
        (loss, metrics): the mean over kept pairs (a zero that still backpropagates when no
        group has a preference); metrics num_pairs, preference_accuracy (implicit reward of
        y_w above y_l) and reward_margin (mean β-scaled implicit margin).

    Raises:
        ValueError: the number of rows is not G·N.
    """
    n_groups, n_per_group = rewards_GN.shape
    if logprobs_BT.shape[0] != n_groups * n_per_group:
        raise ValueError(
            f"pairwise_preference_loss: {logprobs_BT.shape[0]} sequences for rewards of shape "
            f"{tuple(rewards_GN.shape)}; expected {n_groups * n_per_group} (group-major)"
        )
    rewards_GN = rewards_GN.to(logprobs_BT.device)
    m = bool_mask(mask_BT)
    seq_logprob_B = torch.where(m, logprobs_BT, 0).sum(dim=-1)
    seq_ref_B = torch.where(m, ref_logprobs_BT.detach(), 0).sum(dim=-1)
    implicit_GN = (seq_logprob_B - seq_ref_B).view(n_groups, n_per_group)
    best_G = rewards_GN.argmax(dim=1, keepdim=True)
    worst_G = rewards_GN.argmin(dim=1, keepdim=True)
    keep_G = rewards_GN.amax(dim=1) > rewards_GN.amin(dim=1)
    margin_G = beta * (implicit_GN.gather(1, best_G) - implicit_GN.gather(1, worst_G)).squeeze(1)
    # The kept pairs as weights, not as a selection (`margin_G[keep_G]` would make the host wait
    # for the device to learn how many there are); with none, every sum is a (differentiable) 0.
    keep_G = keep_G.to(margin_G.dtype)
    n_pairs = keep_G.sum()
    over = n_pairs.clamp(min=1.0)
    loss = -(F.logsigmoid(margin_G) * keep_G).sum() / over
    metrics = {
        "policy_loss": loss.detach(),
        "num_pairs": n_pairs,
        "preference_accuracy": ((margin_G > 0) * keep_G).sum() / over,
        "reward_margin": (margin_G.detach() * keep_G).sum() / over,
    }
    return loss, metrics
