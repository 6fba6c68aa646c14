"""Generalised advantage estimation (Schulman et al. 2016) for PPO: pure functions on lists.

A sample's decisions are its trained tokens, in order (tool and environment tokens of a
multi-turn episode are part of the transition, not decisions). The reward is the sample's
scalar, received after its last trained token; the critic's value V_t is the value of the
state before trained token t, and the value after the last one is 0 (the episode ended):

    δ_t = r_t + γ V_{t+1} − V_t,    A_t = Σ_k (γλ)^k δ_{t+k},    R_t = A_t + V_t (the critic's
    target).

Departures: no per-token KL in the reward (KL is a loss or a per-sequence reward penalty
here, as for the other estimators); γ and λ run over trained tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gae(reward: float, values_T: torch.Tensor, *, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-token advantages and returns of one sample (see the module docstring).

    Args:
        reward: the sample's reward, at its last trained token.
        values_T: the critic's values of its T trained tokens' states.
        gamma, lam: discount and GAE λ.

    Returns:
        (advantages_T, returns_T), float32.
    """
    values_T = values_T.float()
    n = values_T.numel()
    advantages_T = torch.zeros(n)
    running = 0.0
    for t in range(n - 1, -1, -1):
        next_value = values_T[t + 1].item() if t + 1 < n else 0.0
        r = reward if t == n - 1 else 0.0
        delta = r + gamma * next_value - values_T[t].item()
        running = delta + gamma * lam * running
        advantages_T[t] = running
    return advantages_T, advantages_T + values_T


def whiten(advantages_S: Sequence[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """Advantages normalised to mean 0, std 1 over every token of the batch (as verl's PPO).

    A batch whose advantages are all equal comes back as zeros (no signal, no division by 0).
    """
    flat = torch.cat([a.float() for a in advantages_S]) if advantages_S else torch.zeros(0)
    if flat.numel() < 2 or flat.max() == flat.min():
        return [torch.zeros_like(a) for a in advantages_S]
    mean, std = flat.mean(), flat.std()
    return [(a - mean) / (std + eps) for a in advantages_S]


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R): 1 when the critic predicts its targets, ≤ 0 when it is useless."""
    var = returns.var()
    if returns.numel() < 2 or var == 0:
        return 0.0
    return (1 - (returns - values).var() / var).item()
