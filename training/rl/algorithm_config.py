"""The algorithm as data: `AlgorithmConfig`, the published presets and schedules.

An algorithm = an advantage estimator + a policy loss + its aggregation + optional KL, reward
shaping and dynamic sampling. `AlgorithmConfig` names each choice; the presets (`grpo()`,
`dapo(...)`, `ppo()`, ...) fill them in as the papers do, and take keyword overrides. The
dispatch from a config to advantages and losses is `training.rl.algorithms` (which re-exports
everything here).

What DAPO is here (Yu et al. 2025): clip-higher (0.2 / 0.28) + dynamic sampling + token-level
loss + overlong reward shaping, without a KL term. The pairwise best-vs-worst loss is online
DPO (`online_dpo()`), a different algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

from pydantic import Field, model_validator

from plumbing.errors import ConfigError
from rollouts.config import Strict
from training.rl.kl import KLKind
from training.rl.losses import Aggregation
from training.rl.mismatch import MismatchCorrection, MismatchKind, correction_of

AdvantageEstimator = Literal[
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "reinforce_baseline",
    "gae",
    "distill",
]
LossKind = Literal["pg", "ppo_clip", "gspo", "cispo", "pairwise"]


class OverlongShaping(Strict):
    """DAPO's soft overlong punishment (see `rollouts.rewards.overlong_penalty`)."""

    max_response_len: int = Field(ge=1, description="generation budget in tokens")
    cache_len: int = Field(ge=0, description="penalty ramps up over the last cache_len tokens")
    penalty_factor: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _cache_within_budget(self) -> OverlongShaping:
        if self.cache_len > self.max_response_len:
            raise ValueError(
                f"cache_len ({self.cache_len}) must not exceed max_response_len "
                f"({self.max_response_len})"
            )
        return self


class AlgorithmConfig(Strict):
    """Every choice that defines an RL algorithm; the defaults are GRPO as published."""

    name: str = "grpo"
    advantage: AdvantageEstimator = "grpo"
    scale_by_std: bool = Field(True, description="GRPO only: divide by the group std")
    loss: LossKind = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, le=1, description="ratio lower bound is 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="ratio upper bound is 1 + clip_high")
    aggregation: Aggregation = "seq-mean-token-mean"
    max_tokens_norm: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm's constant: the generation budget"
    )
    kl_kind: KLKind = "k3"
    kl_coef: float = Field(0.0, ge=0, description="0 disables KL (no reference model needed)")
    kl_as_reward: bool = Field(False, description="subtract KL from rewards instead of a loss")
    dpo_beta: float = Field(0.1, gt=0, description="pairwise loss temperature")
    filter_zero_std: bool = Field(False, description="dynamic sampling: drop zero-std groups")
    overlong: OverlongShaping | None = None
    dual_clip: float | None = Field(
        None, gt=1, description="dual-clip bound c for A < 0 (verl's clip_ratio_c = 3); None: off"
    )
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus: loss −= coef × entropy")
    whiten: Literal["sequence", "token"] = Field(
        "token",
        description="REINFORCE++ only: whiten over the batch's response tokens (each sequence "
        "weighted by its length, as the paper and verl), or over sequences (each the same)",
    )
    mask_truncated: bool = Field(
        False, description="train on no truncated sample (DAPO's overlong filtering)"
    )
    gae_gamma: float = Field(1.0, ge=0, le=1, description="PPO (advantage=gae): discount")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="PPO (advantage=gae): GAE lambda")
    value_clip: float | None = Field(
        0.2, gt=0, description="PPO: clip the critic's new values to old ± value_clip"
    )
    distill_coef: float = Field(
        1.0, ge=0, description="distill: weight of the per-token −(student − teacher logprob)"
    )
    distill_discount: float = Field(
        0.0, ge=0, le=1,
        description="distill: each token's advantage adds this discount of the next one's "
        "(a discounted future sum; 0: each token alone, as tinker-cookbook's default)",
    )  # fmt: skip
    distill_reward_coef: float = Field(
        0.0,
        ge=0,
        description="distill: weight of the task reward's GRPO advantage added to every token "
        "(0: pure distillation, the reward is only logged)",
    )
    distill_filter_nats: float | None = Field(
        None, gt=0,
        description="distill: dynamic sampling on the teacher's signal: keep a group only if "
        "one of its sampled tokens is at least this many nats likelier to the student than to "
        "the teacher (rollouts.groups.keep_if_student_errs), over-sampling replacements as "
        "DAPO's filter does; None: train every group",
    )  # fmt: skip
    is_cap: float | None = Field(
        None,
        gt=0,
        description="truncated IS cap for engine/trainer mismatch (None: off): each token's "
        "loss x min(pi_trainer / pi_engine, is_cap), in every mode (off-policy too: the ratio is "
        "then to the trainer's logprobs); for loss=pg also the cap of the weight to the "
        "behaviour policy (None: 2.0). The same as mismatch='tis', mismatch_hi=is_cap",
    )
    mismatch: MismatchKind | None = Field(
        None,
        description="correction for the engine/trainer mismatch (training/rl/mismatch.py): tis, "
        "mis, icepop, seq_tis or seq_mis; None: none (the statistics are reported anyway)",
    )
    mismatch_lo: float | None = Field(
        None, ge=0, description="lower bound on pi_trainer / pi_engine (None: the paper's)"
    )
    mismatch_hi: float | None = Field(
        None, gt=0, description="upper bound on pi_trainer / pi_engine (None: the paper's)"
    )

    @model_validator(mode="after")
    def _sum_norm_has_its_constant(self) -> AlgorithmConfig:
        if self.aggregation == "seq-mean-token-sum-norm" and self.max_tokens_norm is None:
            raise ValueError(
                "aggregation seq-mean-token-sum-norm needs max_tokens_norm, the generation "
                "budget (max_new_tokens, or the episode budget for multi-turn); a width taken "
                "from the batch would make the gradient depend on how rows were cut"
            )
        return self

    @model_validator(mode="after")
    def _distill_filter_needs_a_teacher(self) -> AlgorithmConfig:
        if self.distill_filter_nats is not None and self.advantage != "distill":
            raise ValueError(
                f"distill_filter_nats filters groups on a teacher's logprobs, and "
                f"advantage={self.advantage!r} has no teacher: use preset distill, or drop it"
            )
        return self

    @model_validator(mode="after")
    def _one_mismatch_correction(self) -> AlgorithmConfig:
        if self.mismatch is None:
            if self.mismatch_lo is not None or self.mismatch_hi is not None:
                raise ValueError(
                    "mismatch_lo / mismatch_hi bound a mismatch correction: set mismatch "
                    "(tis, mis, icepop, seq_tis or seq_mis) too, or drop them"
                )
        elif self.is_cap is not None:
            raise ValueError(
                f"is_cap is mismatch='tis' with mismatch_hi=is_cap: give is_cap or "
                f"mismatch={self.mismatch!r}, not both"
            )
        else:
            correction_of(self.mismatch, self.mismatch_lo, self.mismatch_hi)
        if self.loss == "pairwise" and self.mismatch_correction is not None:
            raise ValueError(
                "loss=pairwise (online DPO) has no per-token policy loss to weight: drop "
                "is_cap / mismatch"
            )
        return self

    @property
    def mismatch_correction(self) -> MismatchCorrection | None:
        """The engine/trainer mismatch correction (`mismatch`, or is_cap as "tis"), or None."""
        if self.mismatch is not None:
            return correction_of(self.mismatch, self.mismatch_lo, self.mismatch_hi)
        if self.is_cap is not None:
            return MismatchCorrection("tis", None, self.is_cap)
        return None

    @property
    def needs_ref_logprobs(self) -> bool:
        """Whether a reference model's logprobs are needed (KL, or the pairwise loss)."""
        return self.kl_coef > 0 or self.loss == "pairwise"

    @property
    def needs_ref_in_loss(self) -> bool:
        """Whether the loss itself reads reference logprobs (a KL loss term, or pairwise)."""
        return (self.kl_coef > 0 and not self.kl_as_reward) or self.loss == "pairwise"

    @property
    def needs_critic(self) -> bool:
        """Whether a value model is needed (GAE advantages: PPO)."""
        return self.advantage == "gae"

    @property
    def needs_teacher(self) -> bool:
        """Whether samples must carry a teacher's logprobs (on-policy distillation)."""
        return self.advantage == "distill"

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether trainer logprobs before the update are needed (ratio-based losses, TIS)."""
        return self.loss in ("ppo_clip", "gspo", "cispo") or self.mismatch_correction is not None


def _preset(defaults: dict[str, Any], overrides: dict[str, Any]) -> AlgorithmConfig:
    try:
        return AlgorithmConfig(**{**defaults, **overrides})
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"invalid {defaults['name']} preset override: {exc}") from exc


def grpo(**overrides: Any) -> AlgorithmConfig:
    """GRPO (DeepSeekMath): group-normalised advantages, PPO clip 0.2, per-sequence token mean.

    DeepSeekMath also used a k3 KL loss with β = 0.04; like TRL and verl today the preset
    leaves KL off. Pass kl_coef=0.04 to reproduce the paper.
    """
    return _preset({"name": "grpo"}, overrides)


def dr_grpo(**overrides: Any) -> AlgorithmConfig:
    """Dr.GRPO: mean-centred advantages (no std) and a constant-normalised token sum.

    Pass max_tokens_norm=<the generation budget>, as the paper does (required).
    """
    defaults = {"name": "dr_grpo", "advantage": "dr_grpo", "aggregation": "seq-mean-token-sum-norm"}
    return _preset(defaults, overrides)


def dapo(
    *,
    max_response_len: int,
    cache_len: int | None = None,
    penalty_factor: float = 1.0,
    **overrides: Any,
) -> AlgorithmConfig:
    """DAPO: clip-higher 0.2/0.28, dynamic sampling, token-mean loss, overlong shaping, no KL.

    Args:
        max_response_len: the generation budget the overlong penalty is measured against.
        cache_len: soft-penalty window; default max_response_len // 5 (the paper: 4096 of
            20480).
        penalty_factor: penalty at and beyond the budget.
    """
    overlong = {
        "max_response_len": max_response_len,
        "cache_len": max_response_len // 5 if cache_len is None else cache_len,
        "penalty_factor": penalty_factor,
    }
    defaults = {
        "name": "dapo",
        "clip_high": 0.28,
        "aggregation": "token-mean",
        "filter_zero_std": True,
        "overlong": overlong,
    }
    return _preset(defaults, overrides)


def gspo(**overrides: Any) -> AlgorithmConfig:
    """GSPO: GRPO advantages with a clipped sequence-level ratio (3e-4 / 4e-4)."""
    defaults = {"name": "gspo", "loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4}
    return _preset(defaults, overrides)


def cispo(**overrides: Any) -> AlgorithmConfig:
    """CISPO: GRPO advantages, clipped-and-detached IS weights (no lower bound), token mean."""
    defaults = {
        "name": "cispo",
        "loss": "cispo",
        "clip_low": 1.0,
        "clip_high": 0.28,
        "aggregation": "token-mean",
    }
    return _preset(defaults, overrides)


def rloo(**overrides: Any) -> AlgorithmConfig:
    """RLOO advantages with the PPO clip loss.

    The paper's update is plain REINFORCE (loss="pg"), which is only right exactly on-policy;
    the clipped loss stays correct with one-step-off or stale batches.
    """
    return _preset({"name": "rloo", "advantage": "rloo"}, overrides)


def reinforce_pp(**overrides: Any) -> AlgorithmConfig:
    """REINFORCE++-baseline: group-mean baseline, whitening over the batch's response tokens
    (as the paper and verl's masked_whiten; whiten="sequence" weighs each sequence the same),
    PPO clip, token mean."""
    defaults = {
        "name": "reinforce_pp",
        "advantage": "reinforce_pp_baseline",
        "aggregation": "token-mean",
    }
    return _preset(defaults, overrides)


def reinforce(**overrides: Any) -> AlgorithmConfig:
    """REINFORCE with a batch-mean baseline and the vanilla policy-gradient loss."""
    defaults = {"name": "reinforce", "advantage": "reinforce_baseline", "loss": "pg"}
    return _preset(defaults, overrides)


def ppo(**overrides: Any) -> AlgorithmConfig:
    """PPO with a critic (Schulman et al. 2017; Ouyang et al. 2022 for language models).

    Per-token GAE advantages (γ = 1, λ = 0.95, whitened over the batch's tokens) from a value
    model trained beside the policy (training/rl/critic.py, value loss clipped at 0.2), the
    clipped ratio at 0.2 and a token-mean loss. PPO is made for several updates per batch:
    pair it with train.mini_batches / train.epochs.
    """
    return _preset({"name": "ppo", "advantage": "gae", "aggregation": "token-mean"}, overrides)


def distill(**overrides: Any) -> AlgorithmConfig:
    """On-policy distillation (Agarwal et al. 2024; tinker-cookbook's on_policy_distillation):
    the student samples, a teacher scores the same tokens, and each sampled token's advantage
    is distill_coef × (teacher logprob − student logprob), the negated per-token reverse-KL
    estimate, plus distill_reward_coef × the task reward's GRPO advantage. Token-mean loss,
    no whitening, no discount by default (docs/rl.md, "On-policy distillation").
    """
    defaults = {"name": "distill", "advantage": "distill", "aggregation": "token-mean"}
    return _preset(defaults, overrides)


def online_dpo(**overrides: Any) -> AlgorithmConfig:
    """Online DPO: pairwise loss on each group's best vs worst sample (needs ref logprobs)."""
    return _preset({"name": "online_dpo", "loss": "pairwise"}, overrides)


AlgorithmSchedule: TypeAlias = Callable[[int, Mapping[str, Any]], AlgorithmConfig]
"""(step, the previous step's metrics) -> that step's algorithm.

`run_rl_training` calls it once per step, right after the previous step is logged, with that
step's metrics ({} for the first step of a run or of a resumed run); e.g. lower `kl_coef` once
`reward_mean` passes 0.5. The schedules below ignore the metrics (and may be called with the
step alone)."""


def constant_schedule(config: AlgorithmConfig) -> AlgorithmSchedule:
    """The same algorithm at every step."""

    def schedule(step: int, metrics: Mapping[str, Any] | None = None) -> AlgorithmConfig:
        return config

    return schedule


def switch_at(step: int, first: AlgorithmConfig, then: AlgorithmConfig) -> AlgorithmSchedule:
    """`first` for steps < `step`, `then` from `step` on (e.g. GRPO for 50 steps, then DAPO)."""
    return switch_at_steps(first, {step: then})


def switch_at_steps(first: AlgorithmConfig, switches: Mapping[int, AlgorithmConfig]
                    ) -> AlgorithmSchedule:  # fmt: skip
    """`first`, then `switches[s]` from step s on, for each s in increasing order.

    E.g. `switch_at_steps(grpo(kl_coef=0.2), {30: grpo(kl_coef=0.05), 60: dapo(...)})`.

    Raises:
        ConfigError: a switch step is below 1.
    """
    bad = sorted(s for s in switches if s < 1)
    if bad:
        raise ConfigError(f"algorithm switch steps must be >= 1, got {bad}")
    phases = sorted(switches.items())

    def schedule(step: int, metrics: Mapping[str, Any] | None = None) -> AlgorithmConfig:
        current = first
        for at, config in phases:
            if step >= at:
                current = config
        return current

    return schedule
