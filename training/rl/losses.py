"""Policy losses on per-token logprobs: policy gradient, PPO/GRPO clip, GSPO, CISPO, online DPO.

Conventions shared by every function here:
- `logprobs_BT`: log π_θ of the sampled response tokens, [B, T], carrying the gradient.
  `old_logprobs_BT` / `ref_logprobs_BT`: the same tokens under the behaviour / reference
  policy; treated as constants (detached here).
- `mask_BT`: bool or 0/1 float, 1 on tokens the model sampled and is trained on; 0 on
  prompt, padding and tool/environment tokens. Masked-out positions contribute exactly zero
  loss and zero gradient, even when they hold garbage (they are replaced before any `exp`).
- `advantages_B`: one advantage per sequence, broadcast over its tokens (detached).
- `is_weights_BT`: optional detached per-token multiplier, e.g. `truncated_is_weights`.
- Every loss returns `(loss, metrics)`: a scalar tensor with a gradient, and floats for
  logging. `entropy_estimate` is the mean of −log π over trained tokens, an unbiased entropy
  estimate when the tokens were sampled from (nearly) the current policy; use
  `training.rl.kl.entropy_from_logits` for the exact value when logits are at hand.

Aggregation (`agg`) turns the per-token loss into a scalar; see `aggregate_loss`. For
gradient accumulation over micro-batches, weight each micro-batch's loss by its share of
trained tokens under "token-mean" and by its share of sequences under the "seq-mean-*" modes.
"""

from __future__ import annotations

from typing import Literal

import torch

from plumbing.errors import ConfigError
from training.rl.kl import KLFn, KLKind, bool_mask, kl_estimate, kl_estimator, masked_mean
from training.rl.preference_loss import pairwise_preference_loss as pairwise_preference_loss

DEFAULT_IS_CAP = 2.0  # truncated importance weights' cap when none is configured (as verl's TIS)

Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
LossOutput = tuple[torch.Tensor, dict[str, float]]


def aggregate_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: Aggregation,
    *,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over masked-in tokens.

    Modes:
        "token-mean": Σ loss / number of trained tokens in the batch; every token weighs the
            same (DAPO's token-level loss; long answers are not down-weighted).
        "seq-mean-token-mean": mean over tokens within each sequence, then over sequences
            (the original GRPO objective; each sequence weighs the same).
        "seq-mean-token-sum": Σ over each sequence's tokens, then mean over sequences (the
            unbiased REINFORCE/RLOO estimator of the sequence-level objective; its scale grows
            with the response length).
        "seq-mean-token-sum-norm": Σ over each sequence's tokens / `max_tokens`, then mean
            over sequences (Dr.GRPO: a constant normaliser, so no length bias).
    Sequence means run over all B rows; a row with no trained tokens contributes 0. None of
    the modes depends on how a batch is cut into micro-batches when each micro-batch's loss
    is weighted by its share of tokens (token-mean) or of sequences (the others).

    Args:
        loss_BT: per-token loss.
        mask_BT: trained-token mask.
        mode: one of the modes above.
        max_tokens: the constant for "seq-mean-token-sum-norm": the generation budget (the
            most tokens an episode may sample). Required for that mode.

    Raises:
        ConfigError: unknown mode, or "seq-mean-token-sum-norm" without `max_tokens`.
    """
    m = bool_mask(mask_BT)
    loss_BT = torch.where(m, loss_BT, 0)
    if mode == "token-mean":
        return loss_BT.sum() / m.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return (loss_BT.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum":
        return loss_BT.sum(dim=-1).mean()
    if mode == "seq-mean-token-sum-norm":
        if max_tokens is None:  # the padded width would make it depend on micro-batching
            raise ConfigError(
                "seq-mean-token-sum-norm needs max_tokens (max_tokens_norm): the generation budget"
            )
        return (loss_BT.sum(dim=-1) / max_tokens).mean()
    raise ConfigError(
        f"unknown loss aggregation {mode!r}; use token-mean, seq-mean-token-mean, "
        "seq-mean-token-sum or seq-mean-token-sum-norm"
    )


def _entropy_estimate(logprobs_BT: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return masked_mean(-logprobs_BT.detach(), m)


def _log_ratio(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, m: torch.Tensor):
    """log π_θ − log π_old, 0 on masked-out tokens (so exp never sees garbage)."""
    return torch.where(m, logprobs_BT - old_logprobs_BT.detach(), 0)


def _weighted(loss_BT: torch.Tensor, is_weights_BT: torch.Tensor | None) -> torch.Tensor:
    return loss_BT if is_weights_BT is None else loss_BT * is_weights_BT.detach()


def policy_gradient_loss(
    logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    old_logprobs_BT: torch.Tensor | None = None,
    is_cap: float = DEFAULT_IS_CAP,
    agg: Aggregation = "token-mean",
    max_tokens: int | None = None,
    is_weights_BT: torch.Tensor | None = None,
) -> LossOutput:
    """REINFORCE: −sg(w) · A · log π_θ per token, aggregated.

    w = min(π_θ / π_old, is_cap), the truncated importance weight of the current policy to the
    behaviour policy that sampled the tokens (`old_logprobs_BT`: the engine's logprobs in the
    off-policy modes, the trainer's before the first update with several updates per batch).
    On-policy the weight is exactly 1 and this is vanilla policy gradient; without the weight,
    stale samples would get the on-policy gradient. None for `old_logprobs_BT` means on-policy.

    Metrics: pg_is_weight_mean, pg_is_capped_fraction (with old logprobs), kl_to_old,
    entropy_estimate.
    """
    m = bool_mask(mask_BT)
    metrics: dict[str, float] = {}
    loss_BT = -token_advantages(advantages_B, logprobs_BT) * logprobs_BT
    if old_logprobs_BT is not None:
        ratio_BT = torch.exp(_log_ratio(logprobs_BT, old_logprobs_BT, m)).detach()
        weight_BT = ratio_BT.clamp(max=is_cap)
        loss_BT = loss_BT * weight_BT
        metrics |= {
            "pg_is_weight_mean": masked_mean(weight_BT, m).detach(),
            "pg_is_capped_fraction": masked_mean((ratio_BT > is_cap).float(), m).detach(),
            "kl_to_old": _kl_to_old(old_logprobs_BT, logprobs_BT, m),
        }
    loss = aggregate_loss(_weighted(loss_BT, is_weights_BT), m, agg, max_tokens=max_tokens)
    return loss, {"policy_loss": loss.detach(), **metrics,
                  "entropy_estimate": _entropy_estimate(logprobs_BT, m)}  # fmt: skip


def _kl_to_old(old_logprobs_BT: torch.Tensor, logprobs_BT: torch.Tensor, m: torch.Tensor
               ) -> torch.Tensor:  # fmt: skip
    """k3 estimate of KL(π_old ‖ π_θ) over trained tokens: how far the update has moved."""
    return masked_mean(kl_estimate(old_logprobs_BT, logprobs_BT.detach(), "k3", mask_BT=m), m)


def token_advantages(advantages: torch.Tensor, like_BT: torch.Tensor) -> torch.Tensor:
    """Advantages as a detached [B, T] tensor: one per sequence ([B], broadcast over its
    tokens) or already one per token ([B, T], e.g. GAE's)."""
    adv = advantages.detach()
    return adv[:, None].expand_as(like_BT) if adv.dim() == 1 else adv


def _clipped_surrogate(ratio_BT, advantages_B, clip_low: float, clip_high: float,
                       dual_clip: float | None = None):  # fmt: skip
    """PPO's pessimistic surrogate max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)), where the clipped
    branch is the active one (its gradient is zero there), and where dual-clip is.

    Dual-clip (Ye et al. 2020, verl's clip_ratio_c): for A < 0 the surrogate is also capped at
    −A·c, so a token whose ratio has grown huge cannot dominate the batch with an unbounded
    negative-advantage term."""
    adv = token_advantages(advantages_B, ratio_BT)
    unclipped = -adv * ratio_BT
    clipped = -adv * ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = torch.maximum(unclipped, clipped)
    dual_BT = torch.zeros_like(loss_BT, dtype=torch.bool)
    if dual_clip is not None:
        cap_BT = -adv * dual_clip
        dual_BT = (adv < 0) & (loss_BT > cap_BT)
        loss_BT = torch.where(dual_BT, cap_BT, loss_BT)
    return loss_BT, clipped > unclipped, dual_BT


def ppo_clip_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: Aggregation = "token-mean",
    max_tokens: int | None = None,
    is_weights_BT: torch.Tensor | None = None,
) -> LossOutput:
    """PPO/GRPO clipped-ratio loss with separate low/high clip ranges (Schulman et al. 2017).

    r = π_θ / π_old per token, clipped to [1 − clip_low, 1 + clip_high]. DAPO's clip-higher
    (Yu et al. 2025) is clip_low=0.2, clip_high=0.28: low-probability tokens may grow more,
    which keeps entropy from collapsing. `dual_clip` = c > 1 also caps the loss of
    negative-advantage tokens at −A·c (dual-clip PPO; verl uses c = 3).
    `advantages_B` is one per sequence [B] or one per token [B, T] (GAE).

    Metrics: clip_fraction_dual (tokens where the dual clip is active), clip_fraction (trained tokens where the clipped branch is active, i.e. the
    token gets no gradient), clip_fraction_low / _high (split by the sign of A),
    kl_to_old (k3 estimate of KL(π_old ‖ π_θ)), ratio_mean / _min / _max, entropy_estimate.
    """
    m = bool_mask(mask_BT)
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, m)
    ratio_BT = torch.exp(log_ratio_BT)
    loss_BT, clipped_BT, dual_BT = _clipped_surrogate(
        ratio_BT, advantages_B, clip_low, clip_high, dual_clip
    )
    loss = aggregate_loss(_weighted(loss_BT, is_weights_BT), m, agg, max_tokens=max_tokens)
    clipped_BT = clipped_BT & m
    positive_BT = token_advantages(advantages_B, m) > 0
    metrics = {
        "policy_loss": loss.detach(),
        "clip_fraction": masked_mean(clipped_BT.float(), m).detach(),
        "clip_fraction_high": masked_mean((clipped_BT & positive_BT).float(), m).detach(),
        "clip_fraction_low": masked_mean((clipped_BT & ~positive_BT).float(), m).detach(),
        "clip_fraction_dual": masked_mean((dual_BT & m).float(), m).detach(),
        "kl_to_old": _kl_to_old(old_logprobs_BT, logprobs_BT, m),
        **_ratio_spread(ratio_BT, m),
        "entropy_estimate": _entropy_estimate(logprobs_BT, m),
    }
    return loss, metrics


def _ratio_spread(ratio_BT: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor | float]:
    """Mean, min and max of π_θ / π_old over trained tokens (all 1 before the first update, and
    without trained tokens); device tensors, no host sync."""
    ratio_BT = ratio_BT.detach()
    if ratio_BT.numel() == 0:
        return {"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0}
    some, one = m.any(), ratio_BT.new_ones(())
    return {
        "ratio_mean": torch.where(some, masked_mean(ratio_BT, m), one),
        "ratio_min": torch.where(some, ratio_BT.masked_fill(~m, float("inf")).amin(), one),
        "ratio_max": torch.where(some, ratio_BT.masked_fill(~m, float("-inf")).amax(), one),
    }


def gspo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
    agg: Aggregation = "seq-mean-token-mean",
    max_tokens: int | None = None,
    is_weights_BT: torch.Tensor | None = None,
) -> LossOutput:
    """GSPO (Zheng et al. 2025): PPO clipping on a sequence-level ratio.

    s_i = exp(mean over trained tokens of log(π_θ / π_old)), the length-normalised sequence
    likelihood ratio, clipped to [1 − clip_low, 1 + clip_high] (paper: 3e-4 / 4e-4). Written
    in the paper's GSPO-token form, s_i,t = sg(s_i) · π_θ(y_t) / sg(π_θ(y_t)): every token of a
    sequence carries the value s_i, and with the default "seq-mean-token-mean" aggregation the
    gradient equals that of −min(s_i A_i, clip(s_i) A_i) averaged over sequences.

    Metrics: clip_fraction (fraction of sequences clipped), seq_ratio_mean, kl_to_old, the
    token ratios' ratio_mean / _min / _max, entropy_estimate.
    """
    m = bool_mask(mask_BT)
    n_tokens_B = m.sum(dim=-1)
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, m)
    seq_log_ratio_B = log_ratio_BT.sum(dim=-1) / n_tokens_B.clamp(min=1)
    # Value s_i on every token, gradient of log π_θ(y_t); the clamp only guards exp overflow.
    token_log_ratio_BT = (
        seq_log_ratio_B.detach().clamp(max=20.0)[:, None] + logprobs_BT - logprobs_BT.detach()
    )
    ratio_BT = torch.exp(torch.where(m, token_log_ratio_BT, 0))
    loss_BT, clipped_BT, _ = _clipped_surrogate(
        ratio_BT, advantages_B, clip_low, clip_high, dual_clip
    )
    loss = aggregate_loss(_weighted(loss_BT, is_weights_BT), m, agg, max_tokens=max_tokens)
    has_tokens_B = n_tokens_B > 0
    seq_ratio_B = torch.exp(seq_log_ratio_B.detach())
    clipped_B = (clipped_BT & m).any(dim=-1)
    n_seqs = has_tokens_B.sum().clamp(min=1)
    metrics = {
        "policy_loss": loss.detach(),
        "clip_fraction": (clipped_B.sum() / n_seqs).detach(),
        "seq_ratio_mean": (torch.where(has_tokens_B, seq_ratio_B, 0).sum() / n_seqs).detach(),
        "kl_to_old": _kl_to_old(old_logprobs_BT, logprobs_BT, m),
        **_ratio_spread(torch.exp(log_ratio_BT), m),
        "entropy_estimate": _entropy_estimate(logprobs_BT, m),
    }
    return loss, metrics


def cispo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    agg: Aggregation = "token-mean",
    max_tokens: int | None = None,
    is_weights_BT: torch.Tensor | None = None,
) -> LossOutput:
    """CISPO (MiniMax-M1, 2025): −sg(clip(r, 1 − clip_low, 1 + clip_high)) · A · log π_θ.

    Clips the importance weight instead of the update, so every token keeps a gradient
    (PPO's clip drops rare, high-ratio tokens such as "Wait"). The paper sets no lower bound
    and tunes only the upper one; clip_low=1.0 (a lower bound of 0) does that, and
    clip_high=0.28 follows common open implementations (the paper gives no value).

    Metrics: clip_fraction (trained tokens whose weight was truncated), cispo_weight_mean,
    kl_to_old, ratio_mean / _min / _max, entropy_estimate.
    """
    m = bool_mask(mask_BT)
    ratio_BT = torch.exp(_log_ratio(logprobs_BT, old_logprobs_BT, m)).detach()
    weight_BT = ratio_BT.clamp(max(0.0, 1 - clip_low), 1 + clip_high)
    loss_BT = -weight_BT * token_advantages(advantages_B, logprobs_BT) * logprobs_BT
    loss = aggregate_loss(_weighted(loss_BT, is_weights_BT), m, agg, max_tokens=max_tokens)
    metrics = {
        "policy_loss": loss.detach(),
        "clip_fraction": masked_mean((weight_BT != ratio_BT).float(), m).detach(),
        "cispo_weight_mean": masked_mean(weight_BT, m).detach(),
        "kl_to_old": _kl_to_old(old_logprobs_BT, logprobs_BT, m),
        **_ratio_spread(ratio_BT, m),
        "entropy_estimate": _entropy_estimate(logprobs_BT, m),
    }
    return loss, metrics


def kl_loss(
    logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    kind: KLKind = "k3",
    agg: Aggregation = "token-mean",
    max_tokens: int | None = None,
    kl_fn: KLFn | None = None,
) -> LossOutput:
    """KL(π_θ ‖ π_ref) as a loss term (multiply by a coefficient and add to the policy loss).

    Uses reference-model logprobs of the *same* tokens. See `training.rl.kl` for which estimator
    to prefer (k3 is GRPO's; k2 has the unbiased gradient). `kl_fn`, when given, replaces the
    `kind` estimator (e.g. `training.rl.kl.truncated_kl(...)`).

    Returns:
        (loss, {"kl": loss value}).
    """
    m = bool_mask(mask_BT)
    kl_BT = (kl_fn or kl_estimator(kind))(logprobs_BT, ref_logprobs_BT, m)
    loss = aggregate_loss(kl_BT, m, agg, max_tokens=max_tokens)
    return loss, {"kl": loss.detach()}


def entropy_bonus(
    entropy_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    agg: Aggregation = "token-mean",
    max_tokens: int | None = None,
) -> LossOutput:
    """The policy's entropy, aggregated like the policy loss; subtract coef × it from the loss.

    `entropy_BT` is the exact entropy of each predicted distribution (from the tempered logits,
    with gradient), e.g. `training.rl.kl.token_entropy`. Returns (entropy, {"entropy": value}).
    """
    entropy = aggregate_loss(entropy_BT, bool_mask(mask_BT), agg, max_tokens=max_tokens)
    return entropy, {"entropy": entropy.detach()}
