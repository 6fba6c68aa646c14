"""The per-micro-batch RL loss the backend runs, and how micro-batch losses are weighted.

Why a module of its own: `batch.py` turns rollout groups into tensors (data), this is what
the backend calls on each micro-batch's logits (the loss), on every rank: the functions are
module-level so that torchrun ranks rebuild them by import path (training/distributed/wire.py).

Logprob alignment as in batch.py: position t of a row predicts token t+1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plumbing.errors import ConfigError
from training.backend.state import Mean
from training.data.logprob_head import scores_of
from training.data.packing import IGNORE_INDEX
from training.data.scores import ReadsScores, TokenScores
from training.rl.algorithms import AlgorithmConfig, PolicyLossFn, compute_policy_loss
from training.rl.kl import KLFn, logprob_mismatch_metrics
from training.rl.mismatch import SEQUENCE_MEAN_METRICS, TOKEN_MEAN_METRICS, mismatch_statistics

if TYPE_CHECKING:  # annotations only: batch.py re-exports this module's names
    from training.rl.batch import RLBatch


def rl_loss_fn(
    algorithm: AlgorithmConfig,
    *,
    temperature: float = 1.0,
    old_from_rollout: bool = False,
    policy_loss_fn: PolicyLossFn = compute_policy_loss,
    kl_fn: KLFn | None = None,
) -> RLMicrobatchLoss:
    """The backend loss for one RL micro-batch: temperature-scaled logprobs → loss.

    Engine logprobs are those of the temperature-scaled distribution, so the trainer scales its
    logits the same way before comparing or training. The behaviour policy ("old" in the
    ratio) is, in this order: the engine's logprobs with `old_from_rollout` (off-policy samples
    in overlap/async modes) unless the algorithm sets a mismatch correction (`mismatch`, or
    `is_cap`: truncated IS), which corrects for the engine by importance weights instead
    (decoupled: ratio to the trainer's logprobs, each token weighted by a function of
    π_trainer / π_engine, training/rl/mismatch.py; metrics tis_*, icepop_*, ...); the trainer's
    logprobs before the step's first update when the examples carry them (several updates per
    batch, `RLExample.old_logprobs`); otherwise the current logprobs, detached (one update on
    on-policy samples: the same values).
    `policy_loss_fn` (default `compute_policy_loss`) turns those tensors into the loss;
    `kl_fn` is passed to it for the KL term. The backend runs it on the fused logprob head's
    `TokenScores` (training/data/logprob_head.py); called directly it also takes [B, T, V]
    logits.
    """
    return RLMicrobatchLoss(algorithm, temperature, old_from_rollout, policy_loss_fn, kl_fn)


@dataclass(frozen=True)
class RLMicrobatchLoss(ReadsScores):
    """`rl_loss_fn`'s loss (a module-level dataclass: torchrun ranks rebuild it by name)."""

    algorithm: AlgorithmConfig
    temperature: float = 1.0
    old_from_rollout: bool = False
    policy_loss_fn: PolicyLossFn = compute_policy_loss
    kl_fn: KLFn | None = None

    @property
    def wants_entropy(self) -> bool:
        return self.algorithm.entropy_coef > 0

    def __call__(self, inputs: torch.Tensor | TokenScores, batch: RLBatch
                 ) -> tuple[torch.Tensor, dict[str, float | Mean]]:  # fmt: skip
        return rl_microbatch_loss(inputs, batch, algorithm=self.algorithm,
                                  temperature=self.temperature,
                                  old_from_rollout=self.old_from_rollout,
                                  policy_loss_fn=self.policy_loss_fn, kl_fn=self.kl_fn)  # fmt: skip


def rl_microbatch_loss(
    inputs: torch.Tensor | TokenScores,
    batch: RLBatch,
    *,
    algorithm: AlgorithmConfig,
    temperature: float,
    old_from_rollout: bool,
    policy_loss_fn: PolicyLossFn,
    kl_fn: KLFn | None,
) -> tuple[torch.Tensor, dict[str, float | Mean]]:
    """`rl_loss_fn`'s loss on the fused head's `TokenScores` (already tempered) or on [B, T, V]
    logits (tempered here).

    Its metrics are the policy loss's, each mean over tokens, sequences or pairs given as a
    `Mean` of its units (`with_units`), so that the backend merges micro-batches exactly.
    """
    scores = scores_of(inputs, batch, temperature=temperature,
                       entropy=algorithm.entropy_coef > 0)  # fmt: skip
    loss_value, metrics = _policy_loss(scores, batch, algorithm, old_from_rollout,
                                       policy_loss_fn, kl_fn)  # fmt: skip
    return loss_value, with_units(metrics, algorithm, batch)


def _policy_loss(scores, batch, algorithm, old_from_rollout, policy_loss_fn, kl_fn):
    logprobs_BT = scores.logprobs_BT
    mask_BT = (batch.target_ids != IGNORE_INDEX).float()
    common = {"ref_logprobs_BT": batch.ref_logprobs_BT, "rewards_GN": batch.rewards_GN,
              "kl_fn": kl_fn}  # fmt: skip
    if algorithm.entropy_coef > 0:
        common["entropy_BT"] = scores.entropy_BT
    advantages = (batch.token_advantages_BT if batch.token_advantages_BT is not None
                  else batch.advantages_B)  # fmt: skip
    correction = algorithm.mismatch_correction
    if correction is not None and batch.rollout_logprobs_BT is None:
        raise ConfigError(
            f"{algorithm.name}: the mismatch correction ({correction.kind}) needs the engine's "
            "logprobs of every trained token, and this micro-batch's samples have none "
            "(Sample.rollout_logprobs): generate with logprobs, or drop is_cap / mismatch"
        )
    if old_from_rollout and batch.rollout_logprobs_BT is not None and correction is None:
        # the engine's logprobs are the behaviour policy; mismatch is measured against the
        # trainer's current logprobs (before this update) instead. With a correction the
        # trainer's logprobs are (below) and the engine's enter as importance weights.
        loss_value, metrics = policy_loss_fn(
            algorithm, logprobs_BT, batch.rollout_logprobs_BT, advantages, mask_BT, **common
        )  # fmt: skip
        engine_BT, trainer_BT = batch.rollout_logprobs_BT, logprobs_BT.detach()
        mismatch = logprob_mismatch_metrics(trainer_BT, engine_BT, mask_BT)
        mismatch |= mismatch_statistics(trainer_BT, engine_BT, mask_BT)
        return loss_value, {**metrics, **mismatch}
    old_BT = batch.old_logprobs_BT if batch.old_logprobs_BT is not None else logprobs_BT.detach()
    return policy_loss_fn(
        algorithm, logprobs_BT, old_BT, advantages, mask_BT,
        rollout_logprobs_BT=batch.rollout_logprobs_BT, **common,
    )  # fmt: skip


# The loss metrics that are means over a micro-batch's trained tokens, sequences or pairs
# (training/rl/losses.py): each is merged over micro-batches by those units
# (`training.backend.state.Mean`). Any other mean (policy_loss, loss, kl, entropy: aggregated
# like the loss) is merged with the loss's own weights; `*_max` / `*_min` and counts (num_*)
# by their names.
TOKEN_MEANS = frozenset({
    "clip_fraction", "clip_fraction_high", "clip_fraction_low", "clip_fraction_dual",
    "kl_to_old", "ratio_mean", "entropy_estimate", "logprob_diff_mean_abs",
    "pg_is_weight_mean", "pg_is_capped_fraction", "cispo_weight_mean", *TOKEN_MEAN_METRICS,
})  # fmt: skip
GSPO_SEQUENCE_MEANS = frozenset({"clip_fraction", "seq_ratio_mean"})  # of sequences, in GSPO
PAIR_MEANS = frozenset({"preference_accuracy", "reward_margin"})


def with_units(metrics: dict[str, float], algorithm: AlgorithmConfig, batch: RLBatch
               ) -> dict[str, float | Mean]:  # fmt: skip
    """`metrics` with each mean over tokens, sequences or pairs as a `Mean` of its units."""
    trained_B = (batch.target_ids != IGNORE_INDEX).sum(dim=-1)
    n_tokens, n_sequences = trained_B.sum(), (trained_B > 0).sum()  # read with the metrics
    out: dict[str, float | Mean] = {}
    for key, value in metrics.items():
        by_sequence = algorithm.loss == "gspo" and key in GSPO_SEQUENCE_MEANS
        if by_sequence or key in SEQUENCE_MEAN_METRICS:  # (the mismatch's per-sequence ratios)
            out[key] = Mean(value, n_sequences)
        elif key in TOKEN_MEANS:
            out[key] = Mean(value, n_tokens)
        elif key in PAIR_MEANS:
            out[key] = Mean(value, metrics.get("num_pairs", 0.0))
        else:
            out[key] = value
    return out


def loss_weight_fn(algorithm: AlgorithmConfig):
    """How micro-batch losses are weighted into the step loss: by tokens or by sequences."""
    if algorithm.loss == "pairwise":  # a mean over pairs, whatever the aggregation
        return n_sequences  # two per pair
    return trained_tokens if algorithm.aggregation == "token-mean" else n_sequences


def trained_tokens(batch: RLBatch) -> float:
    return batch.n_trained_tokens


def n_sequences(batch: RLBatch) -> float:
    return batch.n_samples
