"""Properties the RL maths must hold in every setting a config allows (issue 13's defects).

Each test pins a property, not an implementation: a KL to an identical reference is 0, a group
of equal rewards carries no signal, a gradient does not depend on how rows were cut, ...
"""

from __future__ import annotations

import pytest
import torch

from rollouts.errors import ConfigError
from rollouts.rewards import TOTAL, overlong_penalty
from rollouts.types import RolloutBatch, Sample
from tests.rl_helpers import batch_of, grads_of, rl_backend
from training.backend.pytorch import load_model_and_tokenizer
from training.config import load_config
from training.loops.rl import train_on_batch
from training.recipes.rl import algorithm_schedule, generation_budget
from training.rl.algorithms import (
    AlgorithmConfig,
    compute_advantages,
    compute_policy_loss,
    dr_grpo,
    grpo,
    online_dpo,
    reinforce,
    shape_reward,
)
from training.rl.batch import build_examples, loss_weight_fn, rl_loss_fn
from training.rl.kl import token_entropy
from training.rl.reference import make_reference
from training.rl_config import RLRunConfig

# ----- 1. the reference is tempered exactly as the policy ---------------------------------------


@pytest.mark.parametrize("kl_as_reward", [False, True])
async def test_kl_to_an_identical_reference_is_zero_at_any_temperature(
    tiny_model_dir, tmp_path, kl_as_reward
):
    batch = batch_of([[1.0] * 4, [0.5] * 4])  # equal rewards: every advantage is 0
    algo = grpo(kl_coef=0.1, kl_kind="k3", kl_as_reward=kl_as_reward)
    with rl_backend(tiny_model_dir, tmp_path) as policy, make_reference(policy) as reference:
        metrics = await train_on_batch(policy, batch, algo, temperature=0.7,
                                       old_from_rollout=False, reference=reference)  # fmt: skip
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(0.0, abs=1e-6)


def tempered_k1(model_dir, ref_dir, batch, temperature):
    """Mean per-token k1 KL of the tempered distributions, straight from the two HF models."""
    models = [load_model_and_tokenizer(d)[0].eval() for d in (model_dir, ref_dir)]
    total, count = 0.0, 0
    with torch.no_grad():
        for s in batch.samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            lp = [torch.log_softmax(m(input_ids=ids).logits[0] / temperature, -1) for m in models]
            for k, token in enumerate(s.response_ids):
                pos = len(s.prompt_ids) + k - 1
                total += (lp[0][pos, token] - lp[1][pos, token]).item()
                count += 1
    return total / count


@pytest.mark.parametrize("kl_as_reward", [False, True])
async def test_both_kl_paths_measure_the_kl_of_the_tempered_distributions(
    tiny_model_dir, tiny_model_dir_seed1, tmp_path, kl_as_reward
):
    batch = batch_of([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]])
    algo = grpo(kl_coef=0.1, kl_kind="k1", kl_as_reward=kl_as_reward, aggregation="token-mean")
    with (
        rl_backend(tiny_model_dir, tmp_path) as policy,
        rl_backend(tiny_model_dir_seed1, tmp_path, name="r") as reference,
    ):
        metrics = await train_on_batch(policy, batch, algo, temperature=0.7,
                                       old_from_rollout=False, reference=reference)  # fmt: skip
    expected = tempered_k1(tiny_model_dir, tiny_model_dir_seed1, batch, 0.7)
    assert abs(expected) > 0.05  # different models: a real KL
    assert metrics["kl"] == pytest.approx(expected, rel=1e-4)


async def test_online_dpo_margin_is_zero_against_an_identical_reference(tiny_model_dir, tmp_path):
    batch = batch_of([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]])
    with rl_backend(tiny_model_dir, tmp_path) as policy, make_reference(policy) as reference:
        metrics = await train_on_batch(policy, batch, online_dpo(), temperature=0.7,
                                       old_from_rollout=False, reference=reference)  # fmt: skip
    assert metrics["num_pairs"] == 2
    assert metrics["reward_margin"] == pytest.approx(0.0, abs=1e-6)


# ----- 2. DAPO's overlong shaping counts sampled tokens against the episode budget --------------


def tool_episode(n_sampled: int, n_tool: int) -> Sample:
    """A multi-turn episode: a call, a tool result (not sampled), then the answer."""
    half = n_sampled // 2
    mask = (1,) * half + (0,) * n_tool + (1,) * (n_sampled - half)
    return Sample((5, 6), tuple(range(10, 10 + len(mask))), mask)


def test_overlong_penalty_counts_sampled_tokens_only():
    penalty = overlong_penalty(max_response_len=40, cache_len=8)
    assert penalty(tool_episode(n_sampled=30, n_tool=14)) == 0.0  # 44 tokens, 30 sampled
    assert penalty(tool_episode(n_sampled=36, n_tool=14)) == pytest.approx(-0.5)
    assert penalty(tool_episode(n_sampled=41, n_tool=0)) == -1.0


def test_dapo_does_not_punish_a_correct_tool_episode_within_its_budget():
    config = load_config(RLRunConfig, "configs/tool_tiny.yaml", ["algorithm.preset=dapo"])
    algo = algorithm_schedule(config.algorithm, generation_budget(config))(1)
    assert algo.overlong.max_response_len == config.env.max_response_tokens
    episode = tool_episode(n_sampled=30, n_tool=14)  # 44 tokens; 40 is the per-turn limit
    shaped = shape_reward(algo, lambda sample: 1.0)(episode)
    assert shaped["overlong"] == 0.0 and shaped[TOTAL] == 1.0


# ----- 3. a group whose rewards are all equal carries no signal ----------------------------------

GROUP_BASELINE = ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]
ALL_ESTIMATORS = [*GROUP_BASELINE, "reinforce_pp", "reinforce_baseline"]


@pytest.mark.parametrize("estimator", ALL_ESTIMATORS)
@pytest.mark.parametrize("value", [1.2, 0.1, -3.7, 1e6 + 0.3, 0.7 / 3])
def test_a_batch_of_equal_rewards_has_exactly_zero_advantage(estimator, value):
    rewards_GN = torch.full((3, 8), value)
    lengths_GN = torch.arange(24.0).view(3, 8) % 7 + 1
    advantages = compute_advantages(AlgorithmConfig(advantage=estimator), rewards_GN,
                                    n_tokens_GN=lengths_GN)  # fmt: skip
    assert torch.equal(advantages, torch.zeros_like(rewards_GN))


@pytest.mark.parametrize("estimator", GROUP_BASELINE)
def test_a_group_of_equal_rewards_has_exactly_zero_advantage(estimator):
    gen = torch.Generator().manual_seed(0)
    rewards_GN = torch.rand(64, 8, generator=gen) * 3
    rewards_GN[::2] = rewards_GN[::2, :1]  # every other group: all its samples score the same
    lengths_GN = torch.randint(1, 20, rewards_GN.shape, generator=gen).float()
    advantages = compute_advantages(AlgorithmConfig(advantage=estimator), rewards_GN,
                                    n_tokens_GN=lengths_GN)  # fmt: skip
    assert torch.equal(advantages[::2], torch.zeros_like(advantages[::2]))
    assert (advantages[1::2].abs() > 0).any(dim=1).all()


# ----- 4. the gradient does not depend on how rows were cut into micro-batches ------------------


def test_sum_norm_aggregation_needs_the_generation_budget():
    with pytest.raises(ConfigError, match="max_tokens_norm"):
        dr_grpo()
    with pytest.raises(ValueError, match="max_tokens_norm"):
        AlgorithmConfig(aggregation="seq-mean-token-sum-norm")
    assert dr_grpo(max_tokens_norm=16).max_tokens_norm == 16


@pytest.mark.parametrize(
    "make_algo",
    [
        lambda: dr_grpo(max_tokens_norm=16),
        lambda: grpo(),
        lambda: grpo(aggregation="token-mean"),
        lambda: grpo(aggregation="seq-mean-token-sum"),
    ],
    ids=["dr_grpo", "seq-mean-token-mean", "token-mean", "seq-mean-token-sum"],
)
async def test_gradient_does_not_depend_on_micro_batching(tiny_model_dir, tmp_path, make_algo):
    algo = make_algo()
    lengths = [3, 9, 5, 12, 4, 7, 10, 6]  # unequal responses: padding differs per micro-batch
    batch = batch_of([[1.0, 0.0, 0.3, 0.7], [0.2, 0.9, 0.0, 1.0]],
                     n_response=lambda g, i: lengths[4 * g + i])  # fmt: skip
    examples = build_examples(batch, algo, share_prompts=False)
    loss_fn = rl_loss_fn(algo, temperature=1.0)
    grads = []
    n_microbatches = []
    for budget in (8192, 20):  # one micro-batch, then about one row per micro-batch
        with rl_backend(tiny_model_dir, tmp_path, micro_batch_tokens=budget) as backend:
            m = await backend.forward_backward(
                examples, loss_fn=loss_fn, loss_weight_fn=loss_weight_fn(algo)
            ).result()
            grads.append(await grads_of(backend))
        n_microbatches.append(m["n_microbatches"])
    assert n_microbatches[0] == 1 and n_microbatches[1] >= 3
    for name, g in grads[0].items():
        err = (grads[1][name] - g).abs().max() / g.abs().max()
        assert err < 1e-5, (name, err.item(), g.abs().max().item())


# ----- 5. off-policy REINFORCE is importance-weighted by the behaviour policy -------------------


def test_off_policy_reinforce_applies_the_capped_importance_weight():
    logprobs_BT = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.8]], requires_grad=True)
    mask_BT = torch.ones(2, 3)
    advantages_B = torch.tensor([1.0, -0.5])

    def grad(algo, behaviour_BT):
        logprobs_BT.grad = None
        loss, _ = compute_policy_loss(algo, logprobs_BT, behaviour_BT, advantages_B, mask_BT)
        loss.backward()
        return logprobs_BT.grad.clone()

    on_policy = grad(reinforce(), logprobs_BT.detach())
    stale = logprobs_BT.detach() - 2.0  # sampled by a policy 2 nats less likely: ratio e^2
    torch.testing.assert_close(grad(reinforce(is_cap=2.0), stale), 2.0 * on_policy)
    torch.testing.assert_close(grad(reinforce(is_cap=5.0), stale), 5.0 * on_policy)
    fresh = logprobs_BT.detach() + 0.5  # the behaviour policy liked them more: ratio e^-0.5
    torch.testing.assert_close(
        grad(reinforce(is_cap=2.0), fresh), torch.exp(torch.tensor(-0.5)) * on_policy
    )


# ----- options the algorithms assume: dual-clip, entropy bonus, token whitening, truncation ----


def test_dual_clip_caps_the_loss_of_negative_advantages_only():
    logprobs_BT = torch.tensor([[0.0, -3.0], [0.0, -3.0]], requires_grad=True)
    old_BT = torch.tensor([[-3.0, -3.0], [-3.0, -3.0]])  # first token: ratio e^3 ≈ 20
    mask_BT = torch.ones(2, 2)
    advantages_B = torch.tensor([-1.0, 1.0])
    algo = grpo(dual_clip=3.0, aggregation="token-mean")
    loss, metrics = compute_policy_loss(algo, logprobs_BT, old_BT, advantages_B, mask_BT)
    loss.backward()
    # A < 0, ratio 20: PPO's max(20, 1.2) = 20 is capped at c = 3, with no gradient
    # A > 0, ratio 20: the usual clip at 1.2 (no gradient either); ratio-1 tokens: −A·1 each.
    assert loss.item() == pytest.approx((3.0 - 1.0 - 1.2 + 1.0) / 4)
    assert logprobs_BT.grad[0, 0] == 0.0 and metrics["clip_fraction_dual"] == 0.25
    plain, _ = compute_policy_loss(grpo(aggregation="token-mean"), logprobs_BT, old_BT,
                                   advantages_B, mask_BT)  # fmt: skip
    assert plain.item() == pytest.approx((torch.exp(torch.tensor(3.0)).item() - 1 - 1.2 + 1) / 4)


def test_entropy_bonus_raises_the_policy_entropy():
    logits_BTV = torch.tensor([[[4.0, 0.0, -1.0], [2.0, 1.0, 0.0]]], requires_grad=True)
    targets_BT = torch.tensor([[0, 1]])
    algo = grpo(entropy_coef=0.5)
    entropy_before = torch.special.entr(torch.softmax(logits_BTV, -1)).sum().item()
    for _ in range(20):
        logprobs_BT = torch.log_softmax(logits_BTV, -1).gather(-1, targets_BT[..., None])[..., 0]
        loss, metrics = compute_policy_loss(
            algo, logprobs_BT, logprobs_BT.detach(), torch.zeros(1), torch.ones(1, 2),
            entropy_BT=token_entropy(logits_BTV),
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, logits_BTV)
        with torch.no_grad():
            logits_BTV -= grad
    assert torch.special.entr(torch.softmax(logits_BTV, -1)).sum().item() > entropy_before + 0.1
    assert metrics["entropy"] > 0
    with pytest.raises(ConfigError, match="entropy_BT"):
        compute_policy_loss(algo, logprobs_BT, logprobs_BT, torch.zeros(1), torch.ones(1, 2))


def test_token_whitening_weights_each_sequence_by_its_length():
    rewards_GN = torch.tensor([[1.0, 0.0, 0.5], [0.2, 1.0, 0.0]])
    lengths_GN = torch.tensor([[2.0, 10.0, 3.0], [7.0, 1.0, 4.0]])
    for estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        algo = AlgorithmConfig(advantage=estimator, whiten="token")
        adv_GN = compute_advantages(algo, rewards_GN, n_tokens_GN=lengths_GN)
        per_token = torch.repeat_interleave(adv_GN.flatten(), lengths_GN.long().flatten())
        assert per_token.mean().item() == pytest.approx(0.0, abs=1e-6)
        assert per_token.std().item() == pytest.approx(1.0, abs=1e-5)
        by_sequence = compute_advantages(AlgorithmConfig(advantage=estimator, whiten="sequence"),
                                         rewards_GN)  # fmt: skip
        same_length = compute_advantages(algo, rewards_GN, n_tokens_GN=torch.full((2, 3), 5.0))
        assert not torch.allclose(adv_GN, by_sequence)
        # equal lengths: token whitening is sequence whitening up to the n-1 in the std
        k = same_length[0, 0] / by_sequence[0, 0]
        assert torch.allclose(same_length, k * by_sequence, atol=1e-5)


def test_truncated_samples_are_masked_but_keep_their_place_in_the_baseline():
    batch = batch_of([[1.0, 0.0, 0.0, 0.0]])
    group = list(batch.groups[0])
    group[3] = Sample(group[3].prompt_ids, group[3].response_ids, group[3].loss_mask,
                      reward=0.0, status="truncated", index_in_group=3)  # fmt: skip
    batch = RolloutBatch((tuple(group),), 1, 0)
    kept = build_examples(batch, grpo(mask_truncated=True), share_prompts=False)
    every = build_examples(batch, grpo(), share_prompts=False)
    assert len(kept) == 3 and len(every) == 4
    assert [e.advantage for e in kept] == [e.advantage for e in every[:3]]
