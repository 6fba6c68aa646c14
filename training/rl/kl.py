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

"k3_ref" estimates the other direction, KL(π_ref ‖ π) (mass-covering: it punishes the policy
for dropping what the reference does, not for visiting what it does not), from the same tokens
sampled from π, with r = π_ref / π as above:
    value    r log r − (r − 1)   unbiased (E_π[r log r] = KL(π_ref ‖ π), E_π[r − 1] = 0), ≥ 0
    gradient −r ∇log π           unbiased for ∇KL(π_ref ‖ π) = −E_π_ref[∇log π]
The value's own derivative in log π is −r log r, not −r, so the gradient is attached
straight-through (value + (−r)·(log π − stop_grad(log π))): a loss term built on it moves the
policy along the true gradient of KL(π_ref ‖ π) in expectation.

`KLFn` is the extension point: `(logprobs_BT, ref_logprobs_BT, mask_BT) -> kl_BT`, per-token
values that are 0 (with no gradient) on masked-out positions. `kl_estimator(kind)` is the
default; `truncated_kl` and `confidence_masked_kl` are variants built on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeAlias

import torch

from plumbing.errors import ConfigError

KLKind = Literal["k1", "k2", "k3", "k3_ref"]
_KINDS = ("k1", "k2", "k3", "k3_ref")
KLFn: TypeAlias = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

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
    """Per-token estimate of KL(π ‖ π_ref) (KL(π_ref ‖ π) for "k3_ref") for tokens sampled from π.

    Args:
        logprobs_BT: log π of the sampled tokens (gradient flows through these).
        ref_logprobs_BT: log π_ref of the same tokens (treated as constants).
        kind: "k1", "k2", "k3" or "k3_ref" (see the module docstring).
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
    if kind == "k3_ref":
        log_r = log_r.clamp(max=_K3_LOG_RATIO_MAX)
        r = torch.exp(log_r.detach())
        value = r * log_r.detach() - (r - 1)
        return value + r * log_r - (r * log_r).detach()  # d/d log π = −r (straight-through)
    raise ValueError(f"unknown KL estimator {kind!r}; use one of {', '.join(_KINDS)}")


def kl_estimator(kind: KLKind = "k3") -> KLFn:
    """`kl_estimate` with a fixed estimator, as a `KLFn`."""
    if kind not in _KINDS:
        raise ConfigError(f"unknown KL estimator {kind!r}; use one of {', '.join(_KINDS)}")

    def kl(logprobs_BT, ref_logprobs_BT, mask_BT) -> torch.Tensor:
        return kl_estimate(logprobs_BT, ref_logprobs_BT, kind, mask_BT=mask_BT)

    return kl


def truncated_kl(
    kind: KLKind = "k3", *, max_kl: float | None = None, max_log_ratio: float | None = None
) -> KLFn:
    """A KL estimator whose per-token values cannot blow up on a few divergent tokens.

    `max_log_ratio` clamps log(π_ref / π) to [−max, max] before the estimator; `max_kl` clamps
    each token's estimate to [−max, max] after it (k1 can be negative). Either way a clamped
    token keeps its bounded value but gets no gradient, as in PPO's clip.

    Raises:
        ConfigError: neither bound given, or a bound is not positive.
    """
    if max_kl is None and max_log_ratio is None:
        raise ConfigError("truncated_kl needs max_kl or max_log_ratio (or both)")
    for name, bound in (("max_kl", max_kl), ("max_log_ratio", max_log_ratio)):
        if bound is not None and bound <= 0:
            raise ConfigError(f"truncated_kl: {name} must be > 0, got {bound}")
    estimate = kl_estimator(kind)

    def kl(logprobs_BT, ref_logprobs_BT, mask_BT) -> torch.Tensor:
        if max_log_ratio is not None:  # log π clamped to log π_ref ± max: the same log-ratio clamp
            ref_BT = ref_logprobs_BT.detach()
            logprobs_BT = torch.clamp(logprobs_BT, ref_BT - max_log_ratio, ref_BT + max_log_ratio)
        kl_BT = estimate(logprobs_BT, ref_logprobs_BT, mask_BT)
        return kl_BT if max_kl is None else kl_BT.clamp(-max_kl, max_kl)

    return kl


def confidence_masked_kl(
    kind: KLKind = "k3",
    *,
    threshold: float,
    on: Literal["policy", "reference"] = "policy",
    keep: Literal["confident", "uncertain"] = "confident",
) -> KLFn:
    """KL only on tokens where one model is confident (p ≥ threshold) or uncertain (p < it).

    p is the probability `on` the policy or the reference gives the sampled token; the choice
    is made on detached values, so only the KL of the kept tokens carries gradient. Tokens
    left out count as 0 KL: the loss's denominator stays the trained tokens, so the penalty's
    scale does not jump when fewer tokens qualify.

    Raises:
        ConfigError: threshold outside (0, 1), or an unknown `on` / `keep`.
    """
    if not 0 < threshold < 1:
        raise ConfigError(f"confidence_masked_kl: threshold must be in (0, 1), got {threshold}")
    if on not in ("policy", "reference") or keep not in ("confident", "uncertain"):
        raise ConfigError(
            f"confidence_masked_kl: on={on!r} keep={keep!r}; use on='policy'|'reference', "
            "keep='confident'|'uncertain'"
        )
    estimate = kl_estimator(kind)
    log_threshold = torch.tensor(threshold).log().item()

    def kl(logprobs_BT, ref_logprobs_BT, mask_BT) -> torch.Tensor:
        judged_BT = (logprobs_BT if on == "policy" else ref_logprobs_BT).detach()
        confident_BT = judged_BT >= log_threshold
        selected_BT = confident_BT if keep == "confident" else ~confident_BT
        return estimate(logprobs_BT, ref_logprobs_BT, bool_mask(mask_BT) & selected_BT)

    return kl


@torch.no_grad()
def kl_reward_penalty(
    logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    kind: KLKind = "k1",
    coef: float = 1.0,
    kl_fn: KLFn | None = None,
) -> torch.Tensor:
    """Per-sequence KL penalty, `coef` × Σ_t KL_t over trained tokens, to subtract from rewards.

    Pass the logprobs of the policy that sampled the tokens (the trainer's old logprobs),
    before computing advantages: `rewards_B - kl_reward_penalty(...)`. `kl_fn`, when given,
    replaces the `kind` estimator.

    Returns:
        [B] detached penalties (sign: positive means more divergence).
    """
    kl_BT = (kl_fn or kl_estimator(kind))(logprobs_BT, ref_logprobs_BT, mask_BT)
    return coef * torch.where(bool_mask(mask_BT), kl_BT, 0).sum(dim=-1)


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
        "logprob_diff_mean_abs": (diff_BT.sum() / m.sum().clamp(min=1)).detach(),
        "logprob_diff_max_abs": diff_BT.max().detach() if diff_BT.numel() else 0.0,
    }


def token_entropy(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each position's predicted distribution, [B, T], with gradient.

    For the entropy bonus in the loss; it materialises a [B, T, V] softmax, so use
    `entropy_from_logits` for metrics only.
    """
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(dim=-1)


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
