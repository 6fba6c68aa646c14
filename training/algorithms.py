"""Algorithm presets and the one dispatch from an `AlgorithmConfig` to advantages and losses.

An algorithm = an advantage estimator + a policy loss + its aggregation + optional KL, reward
shaping and dynamic sampling. `AlgorithmConfig` names each choice; the presets (`grpo()`,
`dapo(...)`, ...) fill them in as the papers do, and take keyword overrides. The RL trainer
calls only `compute_advantages` and `compute_policy_loss`; the rollout side reads
`filter_zero_std` (drop groups with no reward spread, over-sample to refill) and `overlong`
(wrap the reward with `rollouts.rewards.add_overlong_shaping`).

The choice may change during a run: an `AlgorithmSchedule` maps the step to a config, e.g.
`switch_at(50, grpo(), dapo(max_response_len=512))`.

What DAPO is here (Yu et al. 2025): clip-higher (0.2 / 0.28) + dynamic sampling + token-level
loss + overlong reward shaping, without a KL term. The pairwise best-vs-worst loss is online
DPO (`online_dpo()`), a different algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import torch
from pydantic import Field, model_validator

from rollouts.config import Strict
from rollouts.errors import ConfigError
from rollouts.rewards import RewardFn, add_overlong_shaping
from training import advantages as adv
from training.kl import (
    KLFn,
    KLKind,
    bool_mask,
    kl_reward_penalty,
    logprob_mismatch_metrics,
    masked_mean,
    truncated_is_weights,
)
from training.rl_losses import (
    DEFAULT_IS_CAP,
    Aggregation,
    LossOutput,
    cispo_loss,
    entropy_bonus,
    gspo_loss,
    kl_loss,
    pairwise_preference_loss,
    policy_gradient_loss,
    ppo_clip_loss,
)

AdvantageEstimator = Literal[
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "reinforce_baseline",
    "gae",
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
        "sequence",
        description="REINFORCE++ only: whiten per-sequence advantages, or over tokens (each "
        "sequence weighted by its length, as the paper and verl)",
    )
    mask_truncated: bool = Field(
        False, description="train on no truncated sample (DAPO's overlong filtering)"
    )
    gae_gamma: float = Field(1.0, ge=0, le=1, description="PPO (advantage=gae): discount")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="PPO (advantage=gae): GAE lambda")
    value_clip: float | None = Field(
        0.2, gt=0, description="PPO: clip the critic's new values to old ± value_clip"
    )
    is_cap: float | None = Field(
        None,
        gt=0,
        description="truncated IS cap for engine/trainer mismatch (None: off); for loss=pg also "
        "the cap of the weight to the behaviour policy (None: 2.0)",
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
    def needs_old_logprobs(self) -> bool:
        """Whether trainer logprobs before the update are needed (ratio-based losses, TIS)."""
        return self.loss in ("ppo_clip", "gspo", "cispo") or self.is_cap is not None


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
    """REINFORCE++-baseline: group-mean baseline, batch whitening, PPO clip, token mean."""
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
    model trained beside the policy (training/critic.py, value loss clipped at 0.2), the
    clipped ratio at 0.2 and a token-mean loss. PPO is made for several updates per batch:
    pair it with train.mini_batches / train.epochs.
    """
    return _preset({"name": "ppo", "advantage": "gae", "aggregation": "token-mean"}, overrides)


def online_dpo(**overrides: Any) -> AlgorithmConfig:
    """Online DPO: pairwise loss on each group's best vs worst sample (needs ref logprobs)."""
    return _preset({"name": "online_dpo", "loss": "pairwise"}, overrides)


AlgorithmSchedule: TypeAlias = Callable[[int], AlgorithmConfig]


def constant_schedule(config: AlgorithmConfig) -> AlgorithmSchedule:
    """The same algorithm at every step."""

    def schedule(step: int) -> AlgorithmConfig:
        return config

    return schedule


def switch_at(step: int, first: AlgorithmConfig, then: AlgorithmConfig) -> AlgorithmSchedule:
    """`first` for steps < `step`, `then` from `step` on (e.g. GRPO for 50 steps, then DAPO)."""

    def schedule(current: int) -> AlgorithmConfig:
        return first if current < step else then

    return schedule


# ----- the dispatch ----------------------------------------------------------------------------


def shape_reward(config: AlgorithmConfig, reward_fn: RewardFn) -> RewardFn:
    """`reward_fn` with the config's reward shaping (DAPO's overlong penalty) applied."""
    if config.overlong is None:
        return reward_fn
    return add_overlong_shaping(
        reward_fn,
        max_response_len=config.overlong.max_response_len,
        cache_len=config.overlong.cache_len,
        penalty_factor=config.overlong.penalty_factor,
    )


def compute_advantages(config: AlgorithmConfig, rewards_GN: torch.Tensor, *,
                       n_tokens_GN: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Advantages [G, N] from rewards [G, N] with the configured estimator.

    `n_tokens_GN` (trained tokens of each sample) is needed only by REINFORCE++ with
    whiten="token". GAE (PPO) advantages are per token and need a critic: see
    `training.gae`; this returns none for them.

    Raises:
        ConfigError: advantage="gae" (not a function of rewards alone), or token whitening
            without `n_tokens_GN`.
    """
    match config.advantage:
        case "grpo":
            return adv.grpo_advantages(rewards_GN, scale_by_std=config.scale_by_std)
        case "dr_grpo":
            return adv.dr_grpo_advantages(rewards_GN)
        case "rloo":
            return adv.rloo_advantages(rewards_GN)
        case "reinforce_pp" | "reinforce_pp_baseline":
            weights_GN = None
            if config.whiten == "token":
                if n_tokens_GN is None:
                    raise ConfigError("REINFORCE++ with whiten='token' needs n_tokens_GN")
                weights_GN = n_tokens_GN
            return adv.reinforce_pp_advantages(
                rewards_GN, group_baseline=config.advantage == "reinforce_pp_baseline",
                token_weights_GN=weights_GN,
            )  # fmt: skip
        case "reinforce_baseline":
            return adv.reinforce_baseline_advantages(rewards_GN)
        case "gae":
            raise ConfigError(
                f"{config.name}: GAE advantages are per token and come from a critic "
                "(training.gae), not from rewards alone"
            )
    raise ConfigError(f"unknown advantage estimator {config.advantage!r}")


def apply_kl_reward_penalty(
    config: AlgorithmConfig,
    rewards_GN: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    kl_fn: KLFn | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards minus kl_coef × per-sequence KL when `kl_as_reward`; unchanged otherwise.

    Call before `compute_advantages`, with the logprobs of the policy that sampled the batch.
    Rows of the [B, T] tensors are group-major, B = G·N. `kl_fn` replaces `config.kl_kind`.

    Returns:
        (rewards_GN, metrics): "kl_reward_penalty_mean" and "kl", the mean per-token KL.
    """
    if not (config.kl_as_reward and config.kl_coef > 0):
        return rewards_GN, {}
    kl_B = kl_reward_penalty(old_logprobs_BT, ref_logprobs_BT, mask_BT, kind=config.kl_kind,
                             kl_fn=kl_fn)  # fmt: skip
    penalty_GN = config.kl_coef * kl_B.view_as(rewards_GN).to(rewards_GN.dtype)
    kl = (kl_B.sum() / bool_mask(mask_BT).sum().clamp(min=1)).item()
    return rewards_GN - penalty_GN, {"kl_reward_penalty_mean": penalty_GN.mean().item(), "kl": kl}


# The loss extension point: a callable with `compute_policy_loss`'s signature (a custom one may
# wrap it). Written as an alias so that the signature lives in one place, the function below.
PolicyLossFn: TypeAlias = Callable[..., LossOutput]


def compute_policy_loss(
    config: AlgorithmConfig,
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor | None,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    ref_logprobs_BT: torch.Tensor | None = None,
    rollout_logprobs_BT: torch.Tensor | None = None,
    rewards_GN: torch.Tensor | None = None,
    kl_fn: KLFn | None = None,
    entropy_BT: torch.Tensor | None = None,
) -> LossOutput:
    """The training loss for one (micro-)batch under `config`: policy loss (+ KL) (− entropy
    bonus), metrics.

    Args:
        config: the algorithm for this step.
        logprobs_BT: current-policy logprobs of the response tokens (with gradient).
        old_logprobs_BT: trainer logprobs before this update; may be None only for
            loss="pg" without `is_cap` (then the batch is taken as exactly on-policy).
        advantages_B: per-sequence advantages, [B] or [G, N] (flattened here), or per-token
            advantages [B, T] (same shape as `mask_BT`: GAE).
        mask_BT: 1/True on trained response tokens.
        ref_logprobs_BT: reference-model logprobs; required when `config.needs_ref_logprobs`.
        rollout_logprobs_BT: engine logprobs; when given, mismatch metrics are reported and,
            with `is_cap`, truncated IS weights are applied.
        rewards_GN: rewards [G, N]; required by loss="pairwise" to pick each group's pair.
        kl_fn: per-token KL for the KL loss term; default: the `config.kl_kind` estimator.
        entropy_BT: exact per-token entropy with gradient; required when `entropy_coef > 0`.

    Returns:
        (loss, metrics): "loss" is the total; the policy loss's own metrics, "kl" when a KL
        loss is used, logprob_diff_* and tis_* when rollout logprobs are given.

    Raises:
        ConfigError: a tensor the configured algorithm needs was not passed.
    """
    if advantages_B.shape != mask_BT.shape:
        advantages_B = advantages_B.reshape(-1)
    if old_logprobs_BT is None:
        if config.needs_old_logprobs:
            raise ConfigError(f"{config.name} (loss={config.loss!r}) needs old_logprobs_BT")
        old_logprobs_BT = logprobs_BT.detach()
    if config.needs_ref_in_loss and ref_logprobs_BT is None:
        raise ConfigError(f"{config.name} needs ref_logprobs_BT (KL or pairwise loss)")
    if config.entropy_coef > 0 and entropy_BT is None:
        raise ConfigError(f"{config.name} (entropy_coef > 0) needs entropy_BT")
    metrics: dict[str, float] = {}
    is_weights_BT = None
    if rollout_logprobs_BT is not None:
        metrics |= logprob_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
        if config.is_cap is not None:
            is_weights_BT = truncated_is_weights(
                old_logprobs_BT, rollout_logprobs_BT, mask_BT, cap=config.is_cap
            )
            capped_BT = (is_weights_BT >= config.is_cap).float()
            metrics["tis_weight_mean"] = masked_mean(is_weights_BT, mask_BT).item()
            metrics["tis_capped_fraction"] = masked_mean(capped_BT, mask_BT).item()
    common = {
        "agg": config.aggregation,
        "max_tokens": config.max_tokens_norm,
        "is_weights_BT": is_weights_BT,
    }
    clip = {"clip_low": config.clip_low, "clip_high": config.clip_high}
    ratio_clip = {**clip, "dual_clip": config.dual_clip}
    match config.loss:
        case "pg":
            loss, loss_metrics = policy_gradient_loss(
                logprobs_BT, advantages_B, mask_BT, old_logprobs_BT=old_logprobs_BT,
                is_cap=config.is_cap or DEFAULT_IS_CAP, **common,
            )  # fmt: skip
        case "ppo_clip":
            loss, loss_metrics = ppo_clip_loss(
                logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, **ratio_clip, **common
            )
        case "gspo":
            loss, loss_metrics = gspo_loss(
                logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, **ratio_clip, **common
            )
        case "cispo":
            loss, loss_metrics = cispo_loss(
                logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, **clip, **common
            )
        case "pairwise":
            if rewards_GN is None:
                raise ConfigError(f"{config.name} (pairwise loss) needs rewards_GN to pick pairs")
            loss, loss_metrics = pairwise_preference_loss(
                logprobs_BT, ref_logprobs_BT, mask_BT, rewards_GN, beta=config.dpo_beta
            )
        case _:
            raise ConfigError(f"unknown loss {config.loss!r}")
    metrics |= loss_metrics
    if config.kl_coef > 0 and not config.kl_as_reward:
        kl, kl_metrics = kl_loss(
            logprobs_BT,
            ref_logprobs_BT,
            mask_BT,
            kind=config.kl_kind,
            agg=config.aggregation,
            max_tokens=config.max_tokens_norm,
            kl_fn=kl_fn,
        )
        loss = loss + config.kl_coef * kl
        metrics |= kl_metrics
    if config.entropy_coef > 0:
        entropy, entropy_metrics = entropy_bonus(
            entropy_BT, mask_BT, agg=config.aggregation, max_tokens=config.max_tokens_norm
        )
        loss = loss - config.entropy_coef * entropy
        metrics |= entropy_metrics
    metrics["loss"] = loss.item()
    return loss, metrics
