"""Policy losses, KL and importance weights: hand-computed values on toy tensors, and gradients
that are non-zero exactly on masked-in tokens."""

from __future__ import annotations

import math

import pytest
import torch

from rollouts.errors import ConfigError
from training.rl.kl import (
    entropy_from_logits,
    kl_estimate,
    kl_reward_penalty,
    logprob_mismatch_metrics,
    truncated_is_weights,
)
from training.rl.losses import (
    aggregate_loss,
    cispo_loss,
    gspo_loss,
    kl_loss,
    pairwise_preference_loss,
    policy_gradient_loss,
    ppo_clip_loss,
)

LOSS_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


# ----- aggregation -----------------------------------------------------------------------------


def test_token_mean_divides_by_all_trained_tokens():
    assert aggregate_loss(LOSS_BT, MASK_BT, "token-mean").item() == pytest.approx(7 / 3)


def test_seq_mean_token_mean_averages_within_then_across_sequences():
    # ((1 + 2) / 2 + 4 / 1) / 2
    assert aggregate_loss(LOSS_BT, MASK_BT, "seq-mean-token-mean").item() == pytest.approx(2.75)


def test_seq_mean_token_sum_norm_uses_a_constant_normaliser():
    # ((1 + 2) / 4 + 4 / 4) / 2; the padded length is never a fallback (issue 13, defect 4).
    value = aggregate_loss(LOSS_BT, MASK_BT, "seq-mean-token-sum-norm", max_tokens=4)
    assert value.item() == pytest.approx(0.875)
    with pytest.raises(ConfigError, match="max_tokens"):
        aggregate_loss(LOSS_BT, MASK_BT, "seq-mean-token-sum-norm")


def test_seq_mean_token_sum_sums_within_then_averages_across_sequences():
    # ((1 + 2) + 4) / 2
    assert aggregate_loss(LOSS_BT, MASK_BT, "seq-mean-token-sum").item() == pytest.approx(3.5)


def test_aggregation_ignores_garbage_and_rejects_unknown_modes():
    garbage_BT = LOSS_BT.masked_fill(MASK_BT == 0, math.inf)
    assert aggregate_loss(garbage_BT, MASK_BT.bool(), "token-mean").item() == pytest.approx(7 / 3)
    with pytest.raises(ConfigError, match="seq-mean-token-sum-norm"):
        aggregate_loss(LOSS_BT, MASK_BT, "sum")


# ----- gradients flow only through masked-in tokens ---------------------------------------------

B, T, V = 4, 5, 7
GRAD_MASK_BT = torch.tensor(
    [[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool
)


def leaf_logits_and_logprobs():
    """A leaf [B, T, V] logits tensor and the logprobs of fixed 'sampled' tokens under it."""
    gen = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(B, T, V, generator=gen, requires_grad=True)
    tokens_BT = torch.randint(0, V, (B, T), generator=gen)
    logprobs_BT = torch.log_softmax(logits_BTV, -1).gather(-1, tokens_BT[..., None]).squeeze(-1)
    noise_BT = 0.05 * torch.randn(B, T, generator=gen)  # ratios stay inside the PPO clip range
    # Garbage where the mask is 0 must not leak into values or gradients.
    other_BT = (logprobs_BT.detach() + noise_BT).masked_fill(~GRAD_MASK_BT, -math.inf)
    return logits_BTV, logprobs_BT, other_BT


ADV_B = torch.tensor([1.0, -0.5, 2.0, -1.5])
REWARDS_GN = torch.tensor([[1.0, 0.0], [0.0, 2.0]])

LOSSES = {
    "pg": lambda lp, other: policy_gradient_loss(lp, ADV_B, GRAD_MASK_BT),
    "ppo": lambda lp, other: ppo_clip_loss(lp, other, ADV_B, GRAD_MASK_BT, clip_high=0.28),
    "gspo": lambda lp, other: gspo_loss(lp, other, ADV_B, GRAD_MASK_BT, clip_low=1.0, clip_high=10),
    "cispo": lambda lp, other: cispo_loss(lp, other, ADV_B, GRAD_MASK_BT),
    "pairwise": lambda lp, other: pairwise_preference_loss(lp, other, GRAD_MASK_BT, REWARDS_GN),
    "kl_k1": lambda lp, other: kl_loss(lp, other, GRAD_MASK_BT, kind="k1"),
    "kl_k2": lambda lp, other: kl_loss(lp, other, GRAD_MASK_BT, kind="k2"),
    "kl_k3": lambda lp, other: kl_loss(lp, other, GRAD_MASK_BT, kind="k3"),
}


@pytest.mark.parametrize("name", LOSSES)
def test_gradient_is_nonzero_exactly_on_masked_in_tokens(name):
    logits_BTV, logprobs_BT, other_BT = leaf_logits_and_logprobs()
    loss, metrics = LOSSES[name](logprobs_BT, other_BT)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(math.isfinite(v) for v in metrics.values())
    loss.backward()
    grad_norm_BT = logits_BTV.grad.abs().sum(-1)
    assert torch.all(grad_norm_BT[~GRAD_MASK_BT] == 0)
    assert torch.all(grad_norm_BT[GRAD_MASK_BT] > 0)


# ----- policy gradient and PPO ------------------------------------------------------------------


def test_policy_gradient_value_and_is_weights():
    logprobs_BT = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    adv_B = torch.tensor([1.0, -2.0])
    loss, metrics = policy_gradient_loss(logprobs_BT, adv_B, mask_BT)
    # -A·logp on trained tokens: 1, 2, -1 → token mean 2/3.
    assert loss.item() == pytest.approx(2 / 3)
    assert metrics["entropy_estimate"] == pytest.approx(3.5 / 3)
    doubled, _ = policy_gradient_loss(
        logprobs_BT, adv_B, mask_BT, is_weights_BT=torch.full((2, 2), 2.0)
    )
    assert doubled.item() == pytest.approx(4 / 3)


def ppo_case():
    """Ratios [1.5, 0.5, (3.0 masked)] with A = +1, [1.1, 0.7, (1.0 masked)] with A = -1."""
    ratios_BT = torch.tensor([[1.5, 0.5, 3.0], [1.1, 0.7, 1.0]])
    old_BT = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -1.5, -1.0]])
    logprobs_BT = (old_BT + ratios_BT.log()).requires_grad_()
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    return logprobs_BT, old_BT, torch.tensor([1.0, -1.0]), mask_BT


def test_ppo_clip_value_gradient_and_clip_fraction():
    logprobs_BT, old_BT, adv_B, mask_BT = ppo_case()
    loss, metrics = ppo_clip_loss(logprobs_BT, old_BT, adv_B, mask_BT)
    # max(-rA, -clip(r)A): -1.2 (clipped), -0.5, 1.1, 0.8 (clipped) → mean 0.05.
    assert loss.item() == pytest.approx(0.05)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["clip_fraction_high"] == pytest.approx(0.25)
    assert metrics["clip_fraction_low"] == pytest.approx(0.25)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    r = torch.tensor([1.5, 0.5, 1.1, 0.7])
    assert metrics["kl_to_old"] == pytest.approx((r - 1 - r.log()).mean().item(), rel=1e-5)
    loss.backward()
    # d/dlogp of -A·r / 4 = -A·r / 4 where unclipped; 0 where the clipped branch is active.
    expected = torch.tensor([[0.0, -0.125, 0.0], [0.275, 0.0, 0.0]])
    assert torch.allclose(logprobs_BT.grad, expected, atol=1e-6)


def test_clip_higher_lets_positive_advantage_tokens_grow_further():
    old_BT = torch.tensor([[-1.0]])
    logprobs_BT = (old_BT + math.log(1.25)).requires_grad_()
    mask_BT, adv_B = torch.ones(1, 1), torch.tensor([1.0])
    _, symmetric = ppo_clip_loss(logprobs_BT, old_BT, adv_B, mask_BT, clip_low=0.2, clip_high=0.2)
    _, dapo = ppo_clip_loss(logprobs_BT, old_BT, adv_B, mask_BT, clip_low=0.2, clip_high=0.28)
    assert (symmetric["clip_fraction"], dapo["clip_fraction"]) == (1.0, 0.0)


# ----- GSPO ------------------------------------------------------------------------------------


def gspo_case():
    old_BT = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -9.0]])
    log_ratio_BT = torch.tensor([[0.2, -0.2, 0.0], [0.3, 0.1, 5.0]])  # last token masked out
    logprobs_BT = (old_BT + log_ratio_BT).requires_grad_()
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logprobs_BT, old_BT, torch.tensor([1.0, -2.0]), mask_BT


def test_gspo_uses_the_sequence_level_ratio():
    logprobs_BT, old_BT, adv_B, mask_BT = gspo_case()
    loss, metrics = gspo_loss(logprobs_BT, old_BT, adv_B, mask_BT, clip_low=1.0, clip_high=10.0)
    # s = exp(mean log-ratio): exp(0) = 1 (not the token-ratio mean 1.013) and exp(0.2).
    s0, s1 = 1.0, math.exp(0.2)
    assert loss.item() == pytest.approx((-1.0 * s0 + 2.0 * s1) / 2, rel=1e-6)
    assert metrics["seq_ratio_mean"] == pytest.approx((s0 + s1) / 2, rel=1e-6)
    assert metrics["clip_fraction"] == 0.0
    # The gradient is that of the sequence objective -mean_i A_i exp(mean_t log r_i,t).
    loss.backward()
    direct_lp = logprobs_BT.detach().clone().requires_grad_()
    m = mask_BT.bool()
    seq_log_ratio = torch.where(m, direct_lp - old_BT, 0).sum(-1) / m.sum(-1)
    (-(adv_B * seq_log_ratio.exp()).mean()).backward()
    assert torch.allclose(logprobs_BT.grad, direct_lp.grad, atol=1e-6)


def test_gspo_clips_whole_sequences():
    logprobs_BT, old_BT, _, mask_BT = gspo_case()
    # Paper ranges (3e-4 / 4e-4): sequence 0 (s = 1) is inside; sequence 1 (s = e^0.2, A > 0)
    # is above 1 + 4e-4, so its clipped branch is active for every one of its tokens.
    loss, metrics = gspo_loss(logprobs_BT, old_BT, torch.tensor([1.0, 2.0]), mask_BT)
    assert metrics["clip_fraction"] == 0.5
    loss.backward()
    assert torch.all(logprobs_BT.grad[1] == 0)  # every token of the clipped sequence
    assert torch.all(logprobs_BT.grad[0] != 0)


# ----- CISPO -----------------------------------------------------------------------------------


def test_cispo_truncates_the_weight_but_keeps_every_token_gradient():
    logprobs_BT = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old_BT = logprobs_BT.detach() - torch.tensor([[math.log(1.5), math.log(0.5)]])
    loss, metrics = cispo_loss(logprobs_BT, old_BT, torch.tensor([1.0]), torch.ones(1, 2))
    # Weights clip(1.5, 0, 1.28) = 1.28 and 0.5: -(1.28·-1 + 0.5·-2) / 2 = 1.14.
    assert loss.item() == pytest.approx(1.14)
    assert metrics["clip_fraction"] == 0.5
    assert metrics["cispo_weight_mean"] == pytest.approx((1.28 + 0.5) / 2)
    loss.backward()
    assert torch.allclose(logprobs_BT.grad, torch.tensor([[-0.64, -0.25]]))


# ----- online DPO ------------------------------------------------------------------------------


def test_pairwise_preference_loss_by_hand():
    # Group 0: best = sample 0, worst = sample 1; group 1: all rewards tied → skipped.
    rewards_GN = torch.tensor([[1.0, 0.0, 0.5], [1.0, 1.0, 1.0]])
    logprobs_BT = torch.tensor(
        [
            [-0.4, -0.6, -9.0],
            [-1.5, -0.5, -9.0],
            [-1.0, -1.0, -1.0],
            [-1.0, 0, 0],
            [-2.0, 0, 0],
            [-3.0, 0, 0],
        ],
        requires_grad=True,
    )
    ref_BT = torch.tensor(
        [
            [-0.5, -1.0, 0.0],
            [-1.0, -0.8, 0.0],
            [-1.0, -1.0, -1.0],
            [0.0, 0, 0],
            [0.0, 0, 0],
            [0.0, 0, 0],
        ]
    )
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0]])
    loss, metrics = pairwise_preference_loss(logprobs_BT, ref_BT, mask_BT, rewards_GN, beta=0.1)
    # Implicit rewards: chosen -1.0 - (-1.5) = 0.5, rejected -2.0 - (-1.8) = -0.2.
    margin = 0.1 * (0.5 - -0.2)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-margin)), rel=1e-6)
    assert metrics == pytest.approx(
        {
            "policy_loss": loss.item(),
            "num_pairs": 1.0,
            "preference_accuracy": 1.0,
            "reward_margin": margin,
        }
    )
    loss.backward()
    assert torch.all(logprobs_BT.grad[2:] == 0)  # neither chosen nor rejected
    assert torch.all(logprobs_BT.grad[:2, 2] == 0)  # masked out


def test_pairwise_preference_loss_without_pairs_is_a_differentiable_zero():
    logprobs_BT = torch.zeros(4, 2, requires_grad=True)
    loss, metrics = pairwise_preference_loss(
        logprobs_BT, torch.zeros(4, 2), torch.ones(4, 2), torch.ones(2, 2)
    )
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_pairs"] == 0.0
    assert torch.all(logprobs_BT.grad == 0)
    with pytest.raises(ValueError, match="group-major"):
        pairwise_preference_loss(logprobs_BT, logprobs_BT, torch.ones(4, 2), torch.ones(3, 2))


# ----- KL --------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logprobs_BT = torch.tensor([[-1.0, -2.0]])
    ref_BT = torch.tensor([[-1.5, -1.0]])  # log r = ref - logp = [-0.5, 1.0]
    assert torch.allclose(kl_estimate(logprobs_BT, ref_BT, "k1"), torch.tensor([[0.5, -1.0]]))
    assert torch.allclose(kl_estimate(logprobs_BT, ref_BT, "k2"), torch.tensor([[0.125, 0.5]]))
    k3 = [math.exp(-0.5) - 1 + 0.5, math.e - 2]
    assert torch.allclose(kl_estimate(logprobs_BT, ref_BT, "k3"), torch.tensor([k3]))
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logprobs_BT, ref_BT, "k4")


def test_k2_and_k3_are_nonnegative():
    gen = torch.Generator().manual_seed(1)
    a, b = -torch.rand(8, 16, generator=gen) * 5, -torch.rand(8, 16, generator=gen) * 5
    assert torch.all(kl_estimate(a, b, "k3") >= 0)
    assert torch.all(kl_estimate(a, b, "k2") >= 0)


def test_kl_loss_value_and_reward_penalty():
    logprobs_BT = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    ref_BT = torch.tensor([[-1.5, -1.0], [-1.0, -7.0]])
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = kl_loss(logprobs_BT, ref_BT, mask_BT, kind="k2")
    assert loss.item() == pytest.approx((0.125 + 0.5 + 0.0) / 3)
    assert metrics["kl"] == pytest.approx(loss.item())
    penalty_B = kl_reward_penalty(logprobs_BT, ref_BT, mask_BT, kind="k1", coef=0.1)
    assert torch.allclose(penalty_B, torch.tensor([0.1 * (0.5 - 1.0), 0.0]))
    assert not penalty_B.requires_grad


# ----- importance sampling and diagnostics -----------------------------------------------------


def test_truncated_is_weights_are_capped_masked_and_detached():
    rollout_BT = torch.tensor([[-1.0, -1.0, 0.0]])
    old_BT = (rollout_BT + torch.tensor([[math.log(3.0), math.log(0.5), 50.0]])).requires_grad_()
    weights_BT = truncated_is_weights(old_BT, rollout_BT, torch.tensor([[1, 1, 0]]), cap=2.0)
    assert torch.allclose(weights_BT, torch.tensor([[2.0, 0.5, 0.0]]))
    assert not weights_BT.requires_grad


def test_logprob_mismatch_metrics():
    a = torch.tensor([[-1.0, -2.0, -3.0]])
    b = torch.tensor([[-1.1, -1.5, 100.0]])
    metrics = logprob_mismatch_metrics(a, b, torch.tensor([[1, 1, 0]]))
    assert metrics == pytest.approx({"logprob_diff_mean_abs": 0.3, "logprob_diff_max_abs": 0.5})


def test_entropy_from_logits_matches_categorical_on_masked_positions():
    gen = torch.Generator().manual_seed(2)
    logits_BTV = torch.randn(2, 3, 5, generator=gen)
    logits_BTV[0, 0] = 0.0  # uniform: entropy log 5
    logits_BTV[1, 2, 0] = -math.inf  # a forbidden token must not produce NaN
    mask_BT = torch.tensor([[1, 0, 1], [0, 1, 1]])
    expected = torch.distributions.Categorical(logits=logits_BTV).entropy()[mask_BT.bool()].mean()
    assert entropy_from_logits(logits_BTV, mask_BT, chunk_tokens=1) == pytest.approx(
        expected.item(), rel=1e-5
    )
    assert entropy_from_logits(torch.zeros(1, 1, 5), torch.ones(1, 1)) == pytest.approx(math.log(5))
    assert entropy_from_logits(logits_BTV, torch.zeros(2, 3)) == 0.0
