"""Algorithm presets, schedules and the dispatch the RL trainer calls."""

from __future__ import annotations

import pydantic
import pytest
import torch

from rollouts.errors import ConfigError
from rollouts.rewards import TOTAL, exact_match_reward
from rollouts.types import Sample
from training.rl import advantages as adv
from training.rl.algorithms import (
    AlgorithmConfig,
    apply_kl_reward_penalty,
    cispo,
    compute_advantages,
    compute_policy_loss,
    constant_schedule,
    dapo,
    dr_grpo,
    grpo,
    gspo,
    online_dpo,
    reinforce,
    reinforce_pp,
    rloo,
    shape_reward,
    switch_at,
)
from training.rl.kl import truncated_is_weights
from training.rl.losses import kl_loss, ppo_clip_loss


def test_dapo_preset_is_the_real_dapo():
    config = dapo(max_response_len=1000)
    assert (config.clip_low, config.clip_high) == (0.2, 0.28)
    assert config.aggregation == "token-mean"
    assert config.filter_zero_std
    assert config.overlong is not None and config.overlong.cache_len == 200
    assert config.loss == "ppo_clip" and config.kl_coef == 0.0


def test_presets_pick_their_estimator_loss_and_aggregation():
    assert (grpo().advantage, grpo().aggregation) == ("grpo", "seq-mean-token-mean")
    assert (dr_grpo(max_tokens_norm=8).advantage, dr_grpo(max_tokens_norm=8).aggregation) == (
        "dr_grpo",
        "seq-mean-token-sum-norm",
    )
    assert (gspo().loss, gspo().clip_low, gspo().clip_high) == ("gspo", 3e-4, 4e-4)
    assert (cispo().loss, cispo().clip_low) == ("cispo", 1.0)
    assert rloo().advantage == "rloo"
    assert reinforce_pp().advantage == "reinforce_pp_baseline"
    assert (reinforce().loss, reinforce().advantage) == ("pg", "reinforce_baseline")
    assert online_dpo().loss == "pairwise" and online_dpo().needs_ref_logprobs
    assert not grpo().needs_ref_logprobs and grpo(kl_coef=0.04).needs_ref_logprobs
    assert not reinforce().needs_old_logprobs and grpo().needs_old_logprobs


def test_preset_overrides_are_validated():
    assert grpo(clip_high=0.3).clip_high == 0.3
    with pytest.raises(ConfigError, match="clip_low"):
        grpo(clip_low=1.5)
    with pytest.raises(ConfigError, match="cluip_high"):
        grpo(cluip_high=0.3)
    with pytest.raises(ConfigError, match="cache_len"):
        dapo(max_response_len=100, cache_len=200)


def test_configs_are_frozen():
    with pytest.raises(pydantic.ValidationError):
        grpo().clip_high = 0.5  # type: ignore[misc]


def test_switch_at_changes_algorithm_at_the_given_step():
    schedule = switch_at(50, grpo(), dapo(max_response_len=512))
    assert [schedule(s).name for s in (0, 49, 50, 1000)] == ["grpo", "grpo", "dapo", "dapo"]
    assert constant_schedule(gspo())(123).name == "gspo"


def test_shape_reward_adds_overlong_penalty_only_when_configured():
    reward = exact_match_reward()
    assert shape_reward(grpo(), reward) is reward
    shaped = shape_reward(dapo(max_response_len=10, cache_len=4), reward)
    sample = Sample((1,), tuple(range(8)), (1,) * 8, response_text="46", metadata={"answer": "46"})
    assert shaped(sample) == pytest.approx({"task": 1.0, "overlong": -0.5, TOTAL: 0.5})


REWARDS_GN = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (grpo(), adv.grpo_advantages(REWARDS_GN)),
        (grpo(scale_by_std=False), adv.dr_grpo_advantages(REWARDS_GN)),
        (dr_grpo(max_tokens_norm=8), adv.dr_grpo_advantages(REWARDS_GN)),
        (rloo(), adv.rloo_advantages(REWARDS_GN)),
        (
            reinforce_pp(whiten="sequence"),
            adv.reinforce_pp_advantages(REWARDS_GN, group_baseline=True),
        ),
        (
            reinforce_pp(advantage="reinforce_pp", whiten="sequence"),
            adv.reinforce_pp_advantages(REWARDS_GN, group_baseline=False),
        ),
        (reinforce(), adv.reinforce_baseline_advantages(REWARDS_GN)),
    ],
)
def test_compute_advantages_dispatches_to_the_estimator(config, expected):
    assert torch.equal(compute_advantages(config, REWARDS_GN), expected)


def toy_batch():
    gen = torch.Generator().manual_seed(0)
    old_BT = -torch.rand(8, 4, generator=gen) * 3
    logprobs_BT = (old_BT + 0.1 * torch.randn(8, 4, generator=gen)).requires_grad_()
    ref_BT = old_BT + 0.2 * torch.randn(8, 4, generator=gen)
    rollout_BT = old_BT + 0.5 * torch.randn(8, 4, generator=gen)
    mask_BT = (torch.rand(8, 4, generator=gen) > 0.3).float()
    return logprobs_BT, old_BT, ref_BT, rollout_BT, mask_BT


def test_compute_policy_loss_matches_the_loss_function_and_adds_kl():
    logprobs_BT, old_BT, ref_BT, _, mask_BT = toy_batch()
    advantages_GN = compute_advantages(grpo(), REWARDS_GN)
    config = dapo(max_response_len=64, kl_coef=0.1, kl_kind="k2")
    loss, metrics = compute_policy_loss(
        config, logprobs_BT, old_BT, advantages_GN, mask_BT, ref_logprobs_BT=ref_BT
    )
    policy, _ = ppo_clip_loss(
        logprobs_BT, old_BT, advantages_GN.reshape(-1), mask_BT, clip_low=0.2, clip_high=0.28
    )
    kl, _ = kl_loss(logprobs_BT, ref_BT, mask_BT, kind="k2", agg="token-mean")
    assert loss.item() == pytest.approx((policy + 0.1 * kl).item())
    assert metrics["loss"] == pytest.approx(loss.item())
    assert {"clip_fraction", "kl_to_old", "kl", "entropy_estimate"} <= metrics.keys()


def test_compute_policy_loss_applies_truncated_is_and_reports_mismatch():
    logprobs_BT, old_BT, _, rollout_BT, mask_BT = toy_batch()
    advantages_B = torch.linspace(-1, 1, 8)
    config = grpo(is_cap=2.0, aggregation="token-mean")
    loss, metrics = compute_policy_loss(
        config, logprobs_BT, old_BT, advantages_B, mask_BT, rollout_logprobs_BT=rollout_BT
    )
    weights_BT = truncated_is_weights(old_BT, rollout_BT, mask_BT, cap=2.0)
    expected, _ = ppo_clip_loss(
        logprobs_BT, old_BT, advantages_B, mask_BT, is_weights_BT=weights_BT
    )
    assert loss.item() == pytest.approx(expected.item())
    assert metrics["logprob_diff_mean_abs"] > 0 and 0 < metrics["tis_capped_fraction"] < 1
    _, without_cap = compute_policy_loss(
        grpo(), logprobs_BT, old_BT, advantages_B, mask_BT, rollout_logprobs_BT=rollout_BT
    )
    assert "logprob_diff_max_abs" in without_cap and "tis_weight_mean" not in without_cap


def test_compute_policy_loss_names_missing_inputs():
    logprobs_BT, old_BT, _, _, mask_BT = toy_batch()
    advantages_B = torch.zeros(8)
    with pytest.raises(ConfigError, match="ref_logprobs_BT"):
        compute_policy_loss(grpo(kl_coef=0.1), logprobs_BT, old_BT, advantages_B, mask_BT)
    with pytest.raises(ConfigError, match="old_logprobs_BT"):
        compute_policy_loss(grpo(), logprobs_BT, None, advantages_B, mask_BT)
    with pytest.raises(ConfigError, match="rewards_GN"):
        compute_policy_loss(
            online_dpo(), logprobs_BT, old_BT, advantages_B, mask_BT, ref_logprobs_BT=old_BT
        )
    loss, _ = compute_policy_loss(reinforce(), logprobs_BT, None, advantages_B, mask_BT)
    assert loss.requires_grad


def test_kl_as_reward_penalises_rewards_and_adds_no_loss_term():
    logprobs_BT, old_BT, ref_BT, _, mask_BT = toy_batch()
    config = grpo(kl_coef=0.5, kl_kind="k1", kl_as_reward=True)
    penalised_GN, metrics = apply_kl_reward_penalty(config, REWARDS_GN, old_BT, ref_BT, mask_BT)
    expected_B = 0.5 * ((old_BT - ref_BT) * mask_BT).sum(-1)
    assert torch.allclose(penalised_GN, REWARDS_GN - expected_B.view(2, 4), atol=1e-6)
    assert metrics["kl_reward_penalty_mean"] == pytest.approx(expected_B.mean().item(), rel=1e-5)
    unchanged, none = apply_kl_reward_penalty(grpo(), REWARDS_GN, old_BT, ref_BT, mask_BT)
    assert unchanged is REWARDS_GN and none == {}
    _, loss_metrics = compute_policy_loss(
        config, logprobs_BT, old_BT, torch.zeros(8), mask_BT, ref_logprobs_BT=ref_BT
    )
    assert "kl" not in loss_metrics


@pytest.mark.parametrize(
    "config",
    [
        grpo(),
        dr_grpo(max_tokens_norm=1),  # one-token responses: the generation budget is 1
        dapo(max_response_len=8),
        gspo(),
        cispo(),
        rloo(),
        reinforce_pp(),
        reinforce(),
        online_dpo(dpo_beta=1.0),
    ],
    ids=lambda c: c.name,
)
def test_every_preset_learns_a_toy_bandit(config: AlgorithmConfig):
    """One-token responses from a 4-way softmax policy, reward 1 for token 2: a few dozen
    on-policy steps through the real dispatch must make token 2 likely."""
    gen = torch.Generator().manual_seed(0)
    logits_V = torch.zeros(4, requires_grad=True)
    ref_logprobs_V = torch.log_softmax(torch.zeros(4), -1)
    n_groups, n_per_group = 4, 4
    for _ in range(40):
        tokens_B = torch.multinomial(
            torch.softmax(logits_V.detach(), -1),
            n_groups * n_per_group,
            replacement=True,
            generator=gen,
        )
        rewards_GN = (tokens_B == 2).float().view(n_groups, n_per_group)
        logprobs_BT = torch.log_softmax(logits_V, -1)[tokens_B][:, None]
        advantages_GN = compute_advantages(config, rewards_GN,
                                           n_tokens_GN=torch.ones_like(rewards_GN))  # fmt: skip
        loss, _ = compute_policy_loss(
            config,
            logprobs_BT,
            logprobs_BT.detach(),
            advantages_GN,
            torch.ones_like(logprobs_BT),
            ref_logprobs_BT=ref_logprobs_V[tokens_B][:, None],
            rewards_GN=rewards_GN,
        )
        (grad_V,) = torch.autograd.grad(loss, logits_V)
        with torch.no_grad():
            logits_V -= 2.0 * grad_V  # plain SGD
    assert torch.softmax(logits_V.detach(), -1)[2] > 0.8
