"""Per-token KL estimators, truncated importance weights and logprob diagnostics.

All functions take [B, T] tensors of log-probabilities of the *same sampled tokens* under two
policies (never a second generation), and a mask that is 1 (or True) on trained response
tokens. Masked-out positions are neutralised before any `exp`, so padding garbage (even
-inf) can never turn into NaN values or gradients.

KL estimators (Schulman, "Approximating KL Divergence", 2020), for KL(π ‖ π_ref) with tokens
sampled from π and log r = log π_ref − log π:
    k1 = −log r            unbiased, high variance, can be negative per token
    k2 = ½ (log r)²        biased, low variance, ≥ 0
    k3 = (r − 1) − log r   unbiased, low variance, ≥ 0 (GRPO's choice)
As a *loss*, k1's gradient is zero in expectation and k3's is biased; k2's gradient matches the
true reverse-KL gradient (Tang & Munos 2025). As a *reward penalty* (no gradient), k1 is the
usual choice.
"""

from __future__ import annotations

from typing import Literal

import torch

KLKind = Literal["k1", "k2", "k3"]

_K3_LOG_RATIO_MAX = 20.0  # exp(20) ≈ 5e8: keeps k3 finite when the policies have drifted apart


def bool_mask(mask_BT: torch.Tensor) -> torch.Tensor:
    """`mask_BT` (bool, int or float 0/1) as a bool tensor."""
    return mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of `x_BT` over masked-in positions (0 when there are none)."""
    m = bool_mask(mask_BT)
    return torch.where(m, x_BT, 0).sum() / m.sum().clamp(min=1)


def kl_estimate(
    logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    kind: KLKind = "k3",
    *,
    mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) for tokens sampled from π.

    Args:
        logprobs_BT: log π of the sampled tokens (gradient flows through these).
        ref_logprobs_BT: log π_ref of the same tokens (treated as constants).
        kind: "k1", "k2" or "k3" (see the module docstring).
        mask_BT: optional; masked-out positions give 0 (and no gradient).

    Returns:
        [B, T] per-token estimates.
    """
    log_r = ref_logprobs_BT.detach() - logprobs_BT
    if mask_BT is not None:
        log_r = torch.where(bool_mask(mask_BT), log_r, 0)
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        log_r = log_r.clamp(max=_K3_LOG_RATIO_MAX)
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; use 'k1', 'k2' or 'k3'")


@torch.no_grad()
def kl_reward_penalty(
    logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    kind: KLKind = "k1",
    coef: float = 1.0,
) -> torch.Tensor:
    """Per-sequence KL penalty, `coef` × Σ_t KL_t over trained tokens, to subtract from rewards.

    Pass the logprobs of the policy that sampled the tokens (the trainer's old logprobs),
    before computing advantages: `rewards_B - kl_reward_penalty(...)`.

    Returns:
        [B] detached penalties (sign: positive means more divergence).
    """
    kl_BT = kl_estimate(logprobs_BT, ref_logprobs_BT, kind, mask_BT=mask_BT)
    return coef * kl_BT.sum(dim=-1)


@torch.no_grad()
def truncated_is_weights(
    trainer_old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    cap: float = 2.0,
) -> torch.Tensor:
    """Truncated importance weights min(π_trainer / π_engine, cap) per token, detached.

    The engine (SGLang, the local engine) and the trainer compute slightly different
    probabilities for the same tokens (kernels, precision, stale weights), so the samples are
    off-policy for the trainer. Multiplying the per-token loss by these weights corrects for
    it; the cap bounds the variance (truncated IS, Yao et al. 2025 "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training"; Espeholt et al. 2018).

    Returns:
        [B, T] weights, 0 on masked-out tokens.
    """
    m = bool_mask(mask_BT)
    log_w = torch.where(m, trainer_old_logprobs_BT - rollout_logprobs_BT, 0)
    return torch.where(m, torch.exp(log_w).clamp(max=cap), 0)


@torch.no_grad()
def logprob_mismatch_metrics(
    a_logprobs_BT: torch.Tensor, b_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, float]:
    """Mean and max |a − b| over masked-in tokens, e.g. trainer vs engine logprobs.

    Returns:
        {"logprob_diff_mean_abs": ..., "logprob_diff_max_abs": ...} (0.0 with no tokens).
    """
    m = bool_mask(mask_BT)
    diff_BT = torch.where(m, (a_logprobs_BT - b_logprobs_BT).abs(), 0)
    return {
        "logprob_diff_mean_abs": (diff_BT.sum() / m.sum().clamp(min=1)).item(),
        "logprob_diff_max_abs": diff_BT.max().item() if diff_BT.numel() else 0.0,
    }


@torch.no_grad()
def entropy_from_logits(
    logits_BTV: torch.Tensor, mask_BT: torch.Tensor, *, chunk_tokens: int = 1024
) -> float:
    """Mean entropy (nats) of the predicted distributions at masked-in positions.

    For metrics only (no gradient). Works through `chunk_tokens` positions at a time in
    float32, so peak extra memory is about 3 × chunk_tokens × V floats rather than a copy of
    the full [B, T, V] logits.
    """
    vocab = logits_BTV.shape[-1]
    flat_logits = logits_BTV.reshape(-1, vocab)
    positions = bool_mask(mask_BT).reshape(-1).nonzero().squeeze(-1)
    if positions.numel() == 0:
        return 0.0
    total = torch.zeros((), dtype=torch.float64, device=logits_BTV.device)
    for chunk in positions.split(chunk_tokens):
        logits = flat_logits[chunk].float()
        probs = torch.softmax(logits, dim=-1)
        total += torch.special.entr(probs).sum(dtype=torch.float64)  # -p log p, 0 at p = 0
    return (total / positions.numel()).item()
