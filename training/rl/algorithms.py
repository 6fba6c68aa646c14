"""Algorithm presets and the one dispatch from an `AlgorithmConfig` to advantages and losses.

The configs and presets live in `training.rl.algorithm_config` and are re-exported here.
An algorithm = an advantage estimator + a policy loss + its aggregation + optional KL, reward
shaping and dynamic sampling. `AlgorithmConfig` names each choice; the presets (`grpo()`,
`dapo(...)`, ...) fill them in as the papers do, and take keyword overrides. The RL trainer
calls only `compute_advantages` and `compute_policy_loss`; the rollout side reads
`filter_zero_std` (drop groups with no reward spread, over-sample to refill) and `overlong`
(`shape_reward`: the reward plus DAPO's overlong penalty). `run_rl_training` hands each step's
algorithm to the rollout manager (`AsyncRolloutManager.use_algorithm`), so `dapo()` gets both
wherever it is used.

The choice may change during a run: an `AlgorithmSchedule` maps the step and the previous
step's metrics to a config, e.g. `switch_at(50, grpo(), dapo(max_response_len=512))`,
`switch_at_steps(grpo(), {30: ..., 60: ...})`, or a function of `metrics["reward_mean"]`.

What DAPO is here (Yu et al. 2025): clip-higher (0.2 / 0.28) + dynamic sampling + token-level
loss + overlong reward shaping, without a KL term. The pairwise best-vs-worst loss is online
DPO (`online_dpo()`), a different algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch

from plumbing.errors import ConfigError
from rollouts.rewards import shape_reward as shape_reward
from training.rl import advantages as adv
from training.rl.algorithm_config import (
    AdvantageEstimator as AdvantageEstimator,
)
from training.rl.algorithm_config import (
    AlgorithmConfig as AlgorithmConfig,
)
from training.rl.algorithm_config import (
    AlgorithmSchedule as AlgorithmSchedule,
)
from training.rl.algorithm_config import (
    LossKind as LossKind,
)
from training.rl.algorithm_config import (
    OverlongShaping as OverlongShaping,
)
from training.rl.algorithm_config import (
    cispo as cispo,
)
from training.rl.algorithm_config import (
    constant_schedule as constant_schedule,
)
from training.rl.algorithm_config import (
    dapo as dapo,
)
from training.rl.algorithm_config import (
    distill as distill,
)
from training.rl.algorithm_config import (
    dr_grpo as dr_grpo,
)
from training.rl.algorithm_config import (
    grpo as grpo,
)
from training.rl.algorithm_config import (
    gspo as gspo,
)
from training.rl.algorithm_config import (
    online_dpo as online_dpo,
)
from training.rl.algorithm_config import (
    ppo as ppo,
)
from training.rl.algorithm_config import (
    reinforce as reinforce,
)
from training.rl.algorithm_config import (
    reinforce_pp as reinforce_pp,
)
from training.rl.algorithm_config import (
    rloo as rloo,
)
from training.rl.algorithm_config import (
    switch_at as switch_at,
)
from training.rl.algorithm_config import (
    switch_at_steps as switch_at_steps,
)
from training.rl.kl import KLFn, bool_mask, kl_reward_penalty, logprob_mismatch_metrics
from training.rl.losses import (
    DEFAULT_IS_CAP,
    LossOutput,
    cispo_loss,
    entropy_bonus,
    gspo_loss,
    kl_loss,
    pairwise_preference_loss,
    policy_gradient_loss,
    ppo_clip_loss,
)
from training.rl.mismatch import STATISTICS_BOUNDS, mismatch_statistics, mismatch_weights

# ----- the dispatch ----------------------------------------------------------------------------


def compute_advantages(config: AlgorithmConfig, rewards_GN: torch.Tensor, *,
                       n_tokens_GN: torch.Tensor | None = None,
                       mask_GN: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Advantages [G, N] from rewards [G, N] with the configured estimator.

    `n_tokens_GN` (trained tokens of each sample) is needed only by REINFORCE++ with
    whiten="token". `mask_GN` marks the real samples of groups of unequal size, padded to N
    (`training.rl.advantages`). GAE (PPO) advantages are per token and need a critic: see
    `training.rl.gae`; this returns none for them.

    Raises:
        ConfigError: advantage="gae" (not a function of rewards alone), or token whitening
            without `n_tokens_GN`.
    """
    match config.advantage:
        case "grpo":
            return adv.grpo_advantages(rewards_GN, scale_by_std=config.scale_by_std,
                                       mask_GN=mask_GN)  # fmt: skip
        case "dr_grpo":
            return adv.dr_grpo_advantages(rewards_GN, mask_GN=mask_GN)
        case "rloo":
            return adv.rloo_advantages(rewards_GN, mask_GN=mask_GN)
        case "reinforce_pp" | "reinforce_pp_baseline":
            weights_GN = None
            if config.whiten == "token":
                if n_tokens_GN is None:
                    raise ConfigError(
                        "REINFORCE++ whitens over tokens (whiten='token', the default): pass "
                        "n_tokens_GN (each sample's trained-token count), or whiten='sequence'"
                    )
                weights_GN = n_tokens_GN
            return adv.reinforce_pp_advantages(
                rewards_GN, group_baseline=config.advantage == "reinforce_pp_baseline",
                token_weights_GN=weights_GN, mask_GN=mask_GN,
            )  # fmt: skip
        case "reinforce_baseline":
            return adv.reinforce_baseline_advantages(rewards_GN, mask_GN=mask_GN)
        case "distill":  # the per-token teacher part is added per sample (training/rl/distill.py)
            if config.distill_reward_coef == 0:
                return torch.zeros_like(rewards_GN)
            task_GN = adv.grpo_advantages(rewards_GN, scale_by_std=config.scale_by_std,
                                          mask_GN=mask_GN)  # fmt: skip
            return config.distill_reward_coef * task_GN
        case "gae":
            raise ConfigError(
                f"{config.name}: GAE advantages are per token and come from a critic "
                "(training.rl.gae), not from rewards alone"
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
        rollout_logprobs_BT: engine logprobs; when given, the mismatch statistics are
            reported and the configured correction (`mismatch`, or `is_cap` as truncated IS)
            weights each token's loss (training/rl/mismatch.py); required with `mismatch`.
        rewards_GN: rewards [G, N]; required by loss="pairwise" to pick each group's pair.
        kl_fn: per-token KL for the KL loss term; default: the `config.kl_kind` estimator.
        entropy_BT: exact per-token entropy with gradient; required when `entropy_coef > 0`.

    Returns:
        (loss, metrics): "loss" is the total; the policy loss's own metrics, "kl" when a KL
        loss is used, logprob_diff_*, mismatch_* and the correction's (tis_*, icepop_*, ...)
        when rollout logprobs are given. Values are 0-dim
        tensors on the loss's device (or floats): the backend reads an op's metrics in one
        transfer after its last micro-batch, so none waits on the host.

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
    correction = config.mismatch_correction
    if rollout_logprobs_BT is not None:
        metrics |= logprob_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
        bounds = STATISTICS_BOUNDS if correction is None else correction.bounds
        metrics |= mismatch_statistics(old_logprobs_BT, rollout_logprobs_BT, mask_BT, bounds)
        if correction is not None:
            is_weights_BT, correction_metrics = mismatch_weights(
                correction, old_logprobs_BT, rollout_logprobs_BT, mask_BT
            )
            metrics |= correction_metrics
    elif config.mismatch is not None:
        raise ConfigError(
            f"{config.name} (mismatch={config.mismatch!r}) needs rollout_logprobs_BT, the "
            "engine's logprobs of the sampled tokens"
        )
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
    metrics["loss"] = loss.detach()  # read by the backend once per op
    return loss, metrics
