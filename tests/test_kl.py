"""KL variants (truncated, confidence-masked) as `KLFn`s: hand-computed values on toy tensors,
gradients only through the tokens they keep, and `kl_fn` replacing the estimator in the KL loss
and the KL reward penalty."""

from __future__ import annotations

import math

import pytest
import torch

from rollouts.errors import ConfigError
from training.rl.algorithms import apply_kl_reward_penalty, compute_policy_loss, grpo
from training.rl.kl import (
    confidence_masked_kl,
    kl_estimate,
    kl_estimator,
    kl_reward_penalty,
    truncated_kl,
)
from training.rl.losses import kl_loss

# One row, four tokens; the last is masked out and holds garbage (-inf) in the reference.
LOGPROBS = [math.log(0.9), math.log(0.5), math.log(0.05), math.log(0.3)]
REF = [math.log(0.6), math.log(0.5), math.log(0.5), -math.inf]
MASK_BT = torch.tensor([[1, 1, 1, 0]])


def toy():
    logprobs_BT = torch.tensor([LOGPROBS], requires_grad=True)
    return logprobs_BT, torch.tensor([REF])


def k1(lp: float, ref: float) -> float:
    return lp - ref


def test_kl_estimator_is_kl_estimate_with_a_fixed_kind():
    logprobs_BT, ref_BT = toy()
    for kind in ("k1", "k2", "k3"):
        expected = kl_estimate(logprobs_BT, ref_BT, kind, mask_BT=MASK_BT)
        assert torch.equal(kl_estimator(kind)(logprobs_BT, ref_BT, MASK_BT), expected)
    with pytest.raises(ConfigError, match="k4"):
        kl_estimator("k4")


def test_truncated_kl_clamps_each_tokens_estimate():
    logprobs_BT, ref_BT = toy()
    kl_BT = truncated_kl("k1", max_kl=1.0)(logprobs_BT, ref_BT, MASK_BT)
    # k1 per token: log(0.9/0.6)=0.405, 0, log(0.05/0.5)=-2.303 → clamped to -1; masked → 0
    expected = [k1(LOGPROBS[0], REF[0]), 0.0, -1.0, 0.0]
    assert kl_BT[0].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_truncated_kl_clamps_the_log_ratio_before_the_estimator():
    logprobs_BT, ref_BT = toy()
    kl_BT = truncated_kl("k3", max_log_ratio=1.0)(logprobs_BT, ref_BT, MASK_BT)
    # token 2: log r = log(0.5/0.05) = 2.303 → 1.0, so k3 = e - 1 - 1
    log_r0 = REF[0] - LOGPROBS[0]
    expected = [math.exp(log_r0) - 1 - log_r0, 0.0, math.e - 2, 0.0]
    assert kl_BT[0].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    kl_BT.sum().backward()
    # d k3 / d logprob = 1 - r: 1 - 0.6/0.9 on token 0, 0 at r = 1, 0 where clamped or masked
    assert logprobs_BT.grad[0].tolist() == pytest.approx([1 / 3, 0.0, 0.0, 0.0], abs=1e-6)


def test_truncated_kl_clamped_tokens_get_no_gradient():
    logprobs_BT, ref_BT = toy()
    truncated_kl("k1", max_kl=1.0)(logprobs_BT, ref_BT, MASK_BT).sum().backward()
    # d k1 / d logprob = 1 on kept tokens; 0 on the clamped token 2 and the masked token 3
    assert logprobs_BT.grad[0].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_truncated_kl_needs_a_positive_bound():
    with pytest.raises(ConfigError, match="max_kl or max_log_ratio"):
        truncated_kl("k3")
    with pytest.raises(ConfigError, match="max_kl must be > 0"):
        truncated_kl("k3", max_kl=0.0)


@pytest.mark.parametrize(
    ("on", "keep", "kept"),
    [
        ("policy", "confident", [True, True, False]),  # p = 0.9, 0.5, 0.05 vs 0.4
        ("policy", "uncertain", [False, False, True]),
        ("reference", "confident", [True, True, True]),  # p_ref = 0.6, 0.5, 0.5
        ("reference", "uncertain", [False, False, False]),
    ],
)
def test_confidence_masked_kl_keeps_only_the_selected_tokens(on, keep, kept):
    logprobs_BT, ref_BT = toy()
    kl_fn = confidence_masked_kl("k1", threshold=0.4, on=on, keep=keep)
    kl_BT = kl_fn(logprobs_BT, ref_BT, MASK_BT)
    full = [k1(lp, ref) for lp, ref in zip(LOGPROBS[:3], REF[:3], strict=True)]
    expected = [v if k else 0.0 for v, k in zip(full, kept, strict=True)] + [0.0]
    assert kl_BT[0].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    kl_BT.sum().backward()
    assert logprobs_BT.grad[0].tolist() == [float(k) for k in kept] + [0.0]


def test_confidence_masked_kl_gradient_reaches_only_masked_in_logits():
    gen = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(3, 6, 5, generator=gen, requires_grad=True)
    tokens_BT = torch.randint(0, 5, (3, 6), generator=gen)
    logprobs_BT = torch.log_softmax(logits_BTV, -1).gather(-1, tokens_BT[..., None]).squeeze(-1)
    ref_BT = logprobs_BT.detach() + 0.3 * torch.randn(3, 6, generator=gen)
    mask_BT = torch.rand(3, 6, generator=gen) > 0.3
    ref_BT = ref_BT.masked_fill(~mask_BT, -math.inf)
    kl_fn = confidence_masked_kl("k3", threshold=0.2)
    loss, metrics = kl_loss(logprobs_BT, ref_BT, mask_BT, kl_fn=kl_fn)
    loss.backward()
    selected_BT = mask_BT & (logprobs_BT.detach() >= math.log(0.2))
    assert 0 < selected_BT.sum() < mask_BT.sum()  # the toy data exercises both sides
    grad_norm_BT = logits_BTV.grad.abs().sum(-1)
    assert torch.all(grad_norm_BT[~selected_BT] == 0)
    assert torch.all(grad_norm_BT[selected_BT] > 0)
    assert math.isfinite(metrics["kl"]) and metrics["kl"] > 0


def test_confidence_masked_kl_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="threshold"):
        confidence_masked_kl(threshold=1.5)
    with pytest.raises(ConfigError, match="on="):
        confidence_masked_kl(threshold=0.5, on="critic")


def test_kl_fn_replaces_the_estimator_in_the_loss_and_the_reward_penalty():
    logprobs_BT, ref_BT = toy()
    kl_fn = truncated_kl("k1", max_kl=1.0)
    loss, metrics = kl_loss(logprobs_BT, ref_BT, MASK_BT, kind="k3", kl_fn=kl_fn)
    assert metrics["kl"] == pytest.approx(loss.item())
    truncated_sum = k1(LOGPROBS[0], REF[0]) + 0.0 - 1.0
    assert loss.item() == pytest.approx(truncated_sum / 3, abs=1e-6)
    penalty_B = kl_reward_penalty(logprobs_BT, ref_BT, MASK_BT, coef=0.5, kl_fn=kl_fn)
    assert penalty_B.tolist() == pytest.approx([0.5 * truncated_sum], abs=1e-6)

    config = grpo(kl_coef=0.5, kl_as_reward=True)
    rewards_GN = torch.tensor([[1.0]])
    shaped_GN, reward_metrics = apply_kl_reward_penalty(
        config, rewards_GN, logprobs_BT.detach(), ref_BT, MASK_BT, kl_fn=kl_fn
    )
    assert shaped_GN.item() == pytest.approx(1.0 - 0.5 * truncated_sum, abs=1e-6)
    assert reward_metrics["kl"] == pytest.approx(truncated_sum / 3, abs=1e-6)

    as_loss = grpo(kl_coef=0.5, kl_kind="k3")
    advantages_B, old_BT = torch.zeros(1), logprobs_BT.detach()
    args = (as_loss, logprobs_BT, old_BT, advantages_B, MASK_BT)
    _, default = compute_policy_loss(*args, ref_logprobs_BT=ref_BT)
    _, custom = compute_policy_loss(*args, ref_logprobs_BT=ref_BT, kl_fn=kl_fn)
    assert custom["kl"] == pytest.approx(truncated_sum / 3, abs=1e-6)
    assert custom["loss"] == pytest.approx(
        float(custom["policy_loss"] + 0.5 * custom["kl"]), abs=1e-6
    )
    assert default["kl"] != pytest.approx(custom["kl"])


def _categorical_pair(seed: int):
    """A policy (logits with gradient) and a reference over 6 tokens, and the tokens' logprobs."""
    gen = torch.Generator().manual_seed(seed)
    logits_V = torch.randn(6, generator=gen, requires_grad=True)
    ref_logprobs_V = torch.log_softmax(torch.randn(6, generator=gen), dim=-1)
    return logits_V, ref_logprobs_V


def test_k3_ref_in_expectation_over_the_policy_is_the_exact_kl_ref_to_policy():
    for seed in range(5):
        logits_V, ref_V = _categorical_pair(seed)
        logprobs_V = torch.log_softmax(logits_V, dim=-1)
        exact = (ref_V.exp() * (ref_V - logprobs_V)).sum()  # KL(π_ref ‖ π), full distributions
        # Every token as a "sample", weighted by how often π samples it: the exact expectation.
        est_V = kl_estimate(logprobs_V[None], ref_V[None], "k3_ref")[0]
        expected = (logprobs_V.exp().detach() * est_V).sum()
        assert expected.item() == pytest.approx(exact.item(), rel=1e-5, abs=1e-7)
        assert (est_V >= 0).all()  # each token's value is ≥ 0, like k3


def test_k3_ref_gradient_matches_autograd_of_the_exact_kl_ref_to_policy():
    for seed in range(5):
        logits_V, ref_V = _categorical_pair(seed)
        logprobs_V = torch.log_softmax(logits_V, dim=-1)
        exact = (ref_V.exp() * (ref_V - logprobs_V)).sum()
        (exact_grad,) = torch.autograd.grad(exact, logits_V)
        logprobs_V = torch.log_softmax(logits_V, dim=-1)
        # The expected loss gradient when tokens are sampled from π: Σ_x π(x) ∇ est(x), with the
        # sampling weights held fixed, as a loss over sampled tokens does.
        est_V = kl_estimate(logprobs_V[None], ref_V[None], "k3_ref")[0]
        (est_grad,) = torch.autograd.grad((logprobs_V.exp().detach() * est_V).sum(), logits_V)
        torch.testing.assert_close(est_grad, exact_grad, rtol=1e-5, atol=1e-6)


def test_k3_ref_is_zero_and_stationary_when_the_models_are_equal():
    logits_V, _ = _categorical_pair(0)
    logprobs_BT = torch.log_softmax(logits_V, dim=-1)[None]
    kl_BT = kl_estimator("k3_ref")(logprobs_BT, logprobs_BT.detach(), torch.ones_like(logprobs_BT))
    assert torch.equal(kl_BT, torch.zeros_like(kl_BT))
    expected_kl = (logprobs_BT.exp().detach() * kl_BT).sum()
    (grad,) = torch.autograd.grad(expected_kl, logits_V)
    assert grad.abs().max().item() < 1e-6  # E_π[−r ∇log π] = −∇Σ π = 0 at r = 1


def test_k3_ref_is_selectable_where_the_other_estimators_are():
    logprobs_BT, ref_BT = toy()
    kl_BT = kl_estimator("k3_ref")(logprobs_BT, ref_BT, MASK_BT)
    r = [math.exp(ref - lp) for lp, ref in zip(LOGPROBS[:3], REF[:3], strict=True)]
    expected = [x * math.log(x) - (x - 1) for x in r] + [0.0]  # masked-out garbage gives 0
    assert kl_BT[0].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert grpo(kl_coef=0.1, kl_kind="k3_ref").kl_kind == "k3_ref"
