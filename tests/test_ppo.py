"""PPO with a critic: GAE, the value loss, and the critic trained beside the policy."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.rl_helpers import batch_of, rl_backend
from training.config import OptimConfig, load_config
from training.rl.algorithms import ppo
from training.rl.batch import build_examples, collate_rl
from training.rl.critic import load_value_model, make_critic, value_loss_fn
from training.rl.gae import explained_variance, gae, whiten
from training.rl.step import train_on_batch, with_gae
from training.rl_config import RLRunConfig

REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]]


def test_gae_with_lambda_one_is_the_monte_carlo_return_minus_the_value():
    values_T = torch.tensor([0.2, 0.5, -0.1])
    advantages_T, returns_T = gae(1.0, values_T, gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages_T, 1.0 - values_T)
    torch.testing.assert_close(returns_T, torch.ones(3))


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    values_T = torch.tensor([0.2, 0.5, -0.1])
    advantages_T, returns_T = gae(1.0, values_T, gamma=0.9, lam=0.0)
    expected = torch.tensor([0.9 * 0.5 - 0.2, 0.9 * -0.1 - 0.5, 1.0 + 0.1])
    torch.testing.assert_close(advantages_T, expected)
    torch.testing.assert_close(returns_T, expected + values_T)


def test_whitening_centres_over_tokens_and_keeps_no_signal_at_zero():
    whitened = whiten([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    flat = torch.cat(whitened)
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert flat.std().item() == pytest.approx(1.0, abs=1e-6)
    assert all(torch.equal(w, torch.zeros(2)) for w in whiten([torch.ones(2), torch.ones(2)]))
    assert explained_variance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 1.0


def test_value_loss_stops_pulling_a_value_past_the_clip(tiny_tokenizer):
    batch = batch_of([[1.0, 0.0]], n_response=lambda g, i: 1)
    examples = build_examples(batch, ppo(), share_prompts=False)
    examples, _ = with_gae(examples, [torch.tensor([0.0]), torch.tensor([0.0])], ppo())
    rl_batch = collate_rl(examples, pad_id=tiny_tokenizer.pad_token_id)
    position = (rl_batch.target_ids != -100).nonzero()  # one trained token per row
    logits = torch.zeros(*rl_batch.target_ids.shape, 1)
    logits[position[:, 0], position[:, 1], 0] = torch.tensor([2.0, 0.05])  # old values: 0
    logits.requires_grad_(True)
    loss, metrics = value_loss_fn(0.2)(logits, rl_batch)
    loss.backward()
    grad = logits.grad[position[:, 0], position[:, 1], 0]
    # row 0 (return 1) moved to 2.0, past old + 0.2: the clipped term (0.2 − 1)² is smaller than
    # (2 − 1)², so the unclipped one applies and still pulls it back; row 1 (return 0) at 0.05 is
    # within the clip. Neither gradient is zero; a value beyond the clip *toward* its return is.
    assert grad[0] > 0 and grad[1] > 0
    assert metrics["value_clip_fraction"] == 0.0
    logits2 = logits.detach().clone()
    logits2[position[0, 0], position[0, 1], 0] = 0.5  # toward the return 1, past the clip 0.2
    logits2.requires_grad_(True)
    loss2, metrics2 = value_loss_fn(0.2)(logits2, rl_batch)
    loss2.backward()
    assert logits2.grad[position[0, 0], position[0, 1], 0] == 0.0
    assert metrics2["value_clip_fraction"] == 0.5


async def test_critic_learns_the_returns_and_ppo_trains_the_policy(tiny_model_dir, tmp_path,
                                                                  capfd, caplog):  # fmt: skip
    caplog.set_level(logging.INFO, logger="rollouts.critic")
    batch = batch_of(REWARDS)
    optim = OptimConfig(lr=3e-3, schedule="constant", weight_decay=0.0)
    with (
        rl_backend(tiny_model_dir, tmp_path) as policy,
        make_critic(tiny_model_dir, policy.tokenizer, optim=optim, max_steps=10,
                    checkpoint_dir=tmp_path / "critic") as critic,
    ):  # fmt: skip
        history = [
            await train_on_batch(
                policy,
                batch,
                ppo(),
                temperature=1.0,
                old_from_rollout=False,
                reference=None,
                critic=critic,
                mini_batches=2,
            )
            for _ in range(6)
        ]
        path = await critic.save_checkpoint(6, {})
        examples = build_examples(batch, ppo(), share_prompts=False)
        values = await critic.compute_values(examples).result()
    assert history[0]["value_mean_before"] == 0.0  # the new head starts every value at 0
    assert history[-1]["critic_value_loss"] < 0.8 * history[0]["critic_value_loss"]
    assert history[-1]["explained_variance"] > history[0]["explained_variance"]
    assert history[0]["grad_norm"] > 0 and history[0]["n_updates"] == 2
    assert (policy.step, critic.step) == (6, 6)
    reloaded = load_value_model(path)  # HF layout with its trained head
    with make_critic(path, policy.tokenizer, optim=optim, max_steps=1,
                     checkpoint_dir=tmp_path / "c2") as again:  # fmt: skip
        torch.testing.assert_close(await again.compute_values(examples).result(), values)
    assert reloaded.score.weight.abs().sum() > 0
    # transformers' LOAD REPORT table (issue 42) is one line of ours: the new value head is said
    # for the LM checkpoint, nothing for the critic's own checkpoint (it has the head)
    captured = capfd.readouterr()
    assert "LOAD REPORT" not in captured.out + captured.err + caplog.text
    loads = [r.getMessage() for r in caplog.records if r.name == "rollouts.critic"]
    assert loads == [
        f"critic: value model from {tiny_model_dir}; new (value head, starts at 0): score.bias, "
        "score.weight; not used (the LM head): lm_head.weight",
        f"critic: value model from {path}",
        f"critic: value model from {path}",
    ]


def test_the_ppo_preset_needs_a_critic():
    config = load_config(RLRunConfig, "configs/rl_tiny.yaml", ["algorithm.preset=ppo"])
    assert config.algorithm.preset == "ppo" and ppo().needs_critic and ppo().loss == "ppo_clip"
