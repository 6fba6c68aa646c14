"""When the engine and the trainer disagree: corrections of the policy loss, and statistics.

The engine (SGLang, the local engine) sampled each token y_t with probability π_infer(y_t); the
trainer computes π_train(y_t) for the same token with other kernels, precision and batch shapes
(and, in the overlap/async modes, newer weights). The samples are off-policy for the trainer by
the per-token ratio r_t = π_train(y_t) / π_infer(y_t), where π_train is the trainer's policy
before this update (decoupled PPO's proximal policy: `old_logprobs_BT`). Each correction turns
the ratios into a detached per-token weight w_t that multiplies the token's policy loss
(`is_weights_BT` of training/rl/losses.py), whatever the loss (PPO clip, GSPO, CISPO, PG):

    tis      w_t = min(r_t, hi)                               hi = 2      token-level truncated IS
    mis      w_t = r_t · 1[lo ≤ r_t ≤ hi]                     [0.5, 2]    token-level masked IS
    icepop   w_t = r_t · 1[α ≤ r_t ≤ β]                       [0.5, 5]    IcePop (Ring-1T)
    seq_tis  w_t = min(ρ_i, hi)                               hi = 2      sequence level, truncated
    seq_mis  w_t = ρ_i · 1[lo ≤ ρ_i ≤ hi]                     [0.999, 1.001]  sequence, masked
    with ρ_i = exp(mean over sequence i's trained tokens of log r_t), the geometric-mean ratio.

Sources (docs/rl.md, "When the engine and trainer disagree", has the formulas and when to use
which): TIS, Yao et al. 2025 "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (cap 2, as verl's rollout_is_threshold); MIS, Liu, Li et al. 2025 "When Speed Kills
Stability" (verl's rollout correction: a missing lower bound is 1/upper); IcePop, Ling Team 2025
"Every Step Evolves" (Ring-1T, arXiv 2510.18855), M(k; α, β) = k on [α, β], else 0, α = 0.5,
β = 5; the geometric-mean sequence ratio as verl's / slime's "geometric" level (verl's
geometric rejection preset bounds it to [0.999, 1.001]).

What a weight of 0 does here: the token (or sequence) gives no gradient but stays in the loss's
normaliser, as in IcePop's objective (1/|y| Σ_t M(r_t)·…). Departure: verl's rejection sampling
also removes rejected tokens from the normaliser; keeping them makes the loss independent of how
a batch is cut into micro-batches and ranks.

`mismatch_statistics` reports the raw ratios whenever the engine's logprobs are there,
corrected or not: mean / max / min ratio, the share of tokens (and of sequences, by ρ) outside
[lo, hi] (the correction's bounds; tis and seq_tis: [1/hi, hi]; no correction: [0.5, 2]), the
per-sequence mean log-ratio (mean over sequences, and the largest |·|), and the k3 estimate of
KL(π_infer ‖ π_train).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from training.rl.kl import bool_mask, masked_mean

MismatchKind = Literal["tis", "mis", "icepop", "seq_tis", "seq_mis"]
MISMATCH_KINDS: tuple[str, ...] = ("tis", "mis", "icepop", "seq_tis", "seq_mis")
# (lo, hi) of each kind when none is given; None: the kind has no such bound
DEFAULT_BOUNDS: dict[str, tuple[float | None, float]] = {
    "tis": (None, 2.0),
    "mis": (0.5, 2.0),
    "icepop": (0.5, 5.0),
    "seq_tis": (None, 2.0),
    "seq_mis": (0.999, 1.001),
}
STATISTICS_BOUNDS = (0.5, 2.0)  # "outside" for the statistics when no correction is configured
_LOG_RATIO_MAX = 20.0  # exp(20) ≈ 5e8: no inf from a token one engine found impossible


@dataclass(frozen=True)
class MismatchCorrection:
    """One correction: its kind and its bounds on the ratio (lo is None for the truncations)."""

    kind: MismatchKind
    lo: float | None
    hi: float

    @property
    def sequence_level(self) -> bool:
        return self.kind.startswith("seq_")

    @property
    def masks(self) -> bool:
        return self.kind in ("mis", "icepop", "seq_mis")

    @property
    def bounds(self) -> tuple[float, float]:
        """[lo, hi] for "outside" in the statistics (a truncation's lo is 1/hi)."""
        return (1.0 / self.hi if self.lo is None else self.lo), self.hi


def correction_of(kind: str, lo: float | None = None, hi: float | None = None
                  ) -> MismatchCorrection:  # fmt: skip
    """The correction `kind` with the paper's bounds where `lo` / `hi` are None.

    Raises:
        ValueError: unknown kind, a lower bound for a truncation, or lo >= hi.
    """
    if kind not in DEFAULT_BOUNDS:
        raise ValueError(f"mismatch={kind!r}: use one of {', '.join(MISMATCH_KINDS)}")
    default_lo, default_hi = DEFAULT_BOUNDS[kind]
    if default_lo is None and lo is not None:
        raise ValueError(
            f"mismatch={kind!r} truncates from above only (min(ratio, hi)); mismatch_lo is for "
            "the masking kinds (mis, icepop, seq_mis): drop it or pick one of those"
        )
    lo = default_lo if lo is None else lo
    hi = default_hi if hi is None else hi
    if lo is not None and lo >= hi:
        raise ValueError(f"mismatch_lo ({lo}) must be below mismatch_hi ({hi})")
    return MismatchCorrection(kind, lo, hi)  # type: ignore[arg-type]


def _log_ratio(trainer_BT: torch.Tensor, engine_BT: torch.Tensor, m: torch.Tensor):
    """log π_train − log π_infer on trained tokens, 0 elsewhere, bounded against overflow."""
    diff_BT = (trainer_BT.detach() - engine_BT.detach()).clamp(-_LOG_RATIO_MAX, _LOG_RATIO_MAX)
    return torch.where(m, diff_BT, 0)


def _sequence_log_ratio(log_ratio_BT: torch.Tensor, m: torch.Tensor):
    """(log ρ_i = mean log ratio over each row's trained tokens, rows that have any)."""
    n_B = m.sum(dim=-1)
    return log_ratio_BT.sum(dim=-1) / n_B.clamp(min=1), n_B > 0


def _sequence_mean(x_B: torch.Tensor, has_B: torch.Tensor) -> torch.Tensor:
    return torch.where(has_B, x_B, 0).sum() / has_B.sum().clamp(min=1)


def _outside(ratio: torch.Tensor, lo: float | None, hi: float) -> torch.Tensor:
    below = ratio < lo if lo is not None else torch.zeros_like(ratio, dtype=torch.bool)
    return below | (ratio > hi)


@torch.no_grad()
def mismatch_weights(correction: MismatchCorrection, trainer_BT: torch.Tensor,
                     engine_BT: torch.Tensor, mask_BT: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """Per-token weights [B, T] of `correction` (0 off the mask), detached, and their metrics.

    Metrics, named after the kind: `<kind>_weight_mean` and `<kind>_capped_fraction` (the
    truncations) or `<kind>_masked_fraction` (the maskings); a mean over trained tokens for the
    token kinds, over sequences (rows with trained tokens) for seq_tis / seq_mis. "tis" keeps the
    names tis_weight_mean / tis_capped_fraction (a weight at the cap counts as capped).
    """
    m = bool_mask(mask_BT)
    log_ratio_BT = _log_ratio(trainer_BT, engine_BT, m)
    kind = correction.kind
    if correction.sequence_level:
        seq_log_ratio_B, has_B = _sequence_log_ratio(log_ratio_BT, m)
        weight_B, flagged, flagged_B = _weigh(torch.exp(seq_log_ratio_B), correction)
        weights_BT = torch.where(m, weight_B[:, None].expand_as(m), 0)
        return weights_BT, {
            f"{kind}_weight_mean": _sequence_mean(weight_B, has_B),
            f"{kind}_{flagged}_fraction": _sequence_mean(flagged_B.float(), has_B),
        }
    weights_BT, flagged, flagged_BT = _weigh(torch.exp(log_ratio_BT), correction)
    weights_BT = torch.where(m, weights_BT, 0)
    return weights_BT, {
        f"{kind}_weight_mean": masked_mean(weights_BT, m),
        f"{kind}_{flagged}_fraction": masked_mean(flagged_BT.float(), m),
    }


def _weigh(ratio: torch.Tensor, correction: MismatchCorrection
           ) -> tuple[torch.Tensor, str, torch.Tensor]:  # fmt: skip
    """(weight, "masked" or "capped", which entries were): a masking correction zeroes a ratio
    outside [lo, hi], a truncating one caps it at hi."""
    if correction.masks:
        dropped = _outside(ratio, correction.lo, correction.hi)
        return torch.where(dropped, 0.0, ratio), "masked", dropped
    weight = ratio.clamp(max=correction.hi)
    return weight, "capped", weight >= correction.hi


@torch.no_grad()
def mismatch_statistics(trainer_BT: torch.Tensor, engine_BT: torch.Tensor, mask_BT: torch.Tensor,
                        bounds: tuple[float, float] = STATISTICS_BOUNDS
                        ) -> dict[str, torch.Tensor | float]:  # fmt: skip
    """Raw statistics of r_t = π_train / π_infer over trained tokens (device tensors).

    mismatch_ratio_mean / _max / _min, mismatch_outside_fraction (tokens with r_t outside
    `bounds`), mismatch_seq_outside_fraction (sequences whose geometric-mean ratio ρ_i is),
    mismatch_seq_log_ratio_mean (mean over sequences of log ρ_i), mismatch_seq_log_ratio_max_abs
    (the largest |log ρ_i|), mismatch_kl_k3 (mean of r − 1 − log r: KL(π_infer ‖ π_train), as
    the tokens were sampled from the engine). With no trained token: ratios 1, the rest 0.
    """
    m = bool_mask(mask_BT)
    lo, hi = bounds
    log_ratio_BT = _log_ratio(trainer_BT, engine_BT, m)
    ratio_BT = torch.exp(log_ratio_BT)
    seq_log_ratio_B, has_B = _sequence_log_ratio(log_ratio_BT, m)
    if m.numel() == 0:
        return {"mismatch_ratio_mean": 1.0, "mismatch_ratio_max": 1.0, "mismatch_ratio_min": 1.0}
    some, one = m.any(), ratio_BT.new_ones(())
    return {
        "mismatch_ratio_mean": torch.where(some, masked_mean(ratio_BT, m), one),
        "mismatch_ratio_max": torch.where(
            some, ratio_BT.masked_fill(~m, float("-inf")).amax(), one
        ),
        "mismatch_ratio_min": torch.where(some, ratio_BT.masked_fill(~m, float("inf")).amin(), one),
        "mismatch_outside_fraction": masked_mean(_outside(ratio_BT, lo, hi).float(), m),
        "mismatch_seq_outside_fraction": _sequence_mean(
            _outside(torch.exp(seq_log_ratio_B), lo, hi).float(), has_B
        ),
        "mismatch_seq_log_ratio_mean": _sequence_mean(seq_log_ratio_B, has_B),
        "mismatch_seq_log_ratio_max_abs": torch.where(has_B, seq_log_ratio_B.abs(), 0).amax(),
        "mismatch_kl_k3": masked_mean(ratio_BT - 1 - log_ratio_BT, m),
    }


# How each metric here is merged over micro-batches and ranks (training/rl/microbatch_loss.py):
# means over trained tokens, and means over sequences; *_max* / *_min* merge by their names.
TOKEN_MEAN_METRICS = frozenset({
    "mismatch_ratio_mean", "mismatch_outside_fraction", "mismatch_kl_k3",
    "tis_weight_mean", "tis_capped_fraction", "mis_weight_mean", "mis_masked_fraction",
    "icepop_weight_mean", "icepop_masked_fraction",
})  # fmt: skip
SEQUENCE_MEAN_METRICS = frozenset({
    "mismatch_seq_outside_fraction", "mismatch_seq_log_ratio_mean",
    "seq_tis_weight_mean", "seq_tis_capped_fraction", "seq_mis_weight_mean",
    "seq_mis_masked_fraction",
})  # fmt: skip
