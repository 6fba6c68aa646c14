"""The choices issue 42 asked to settle, each pinned against an independent computation.

(a) REINFORCE++ whitens over the batch's response tokens by default (the paper, verl);
(b) a group whose rewards differ by float noise gets no O(0.1) GRPO advantage;
(c) DAPO's overlong penalty for an episode cut at its budget, tools or not;
(d) truncated importance sampling with `is_cap` applies in the off-policy modes too.
docs/rl.md ("Choices") says why.
"""

from __future__ import annotations

import pytest
import torch

from rollouts.groups import keep_if_reward_varies
from tests.rl_helpers import batch_of
from training.rl.algorithms import (
    AlgorithmConfig,
    compute_advantages,
    dapo,
    reinforce_pp,
    shape_reward,
)
from training.rl.batch import build_examples

# ----- (a) REINFORCE++ whitening -----------------------------------------------------------------


def _length(g: int, i: int) -> int:
    return 1 + (5 * g + 3 * i) % 9


def test_reinforce_pp_whitens_over_the_batch_response_tokens_by_default():
    """verl's reinforce_plus_plus(_baseline): the score (minus its group's mean) on every
    response token, then masked_whiten over all response tokens of the batch (unbiased
    variance, rsqrt(var + 1e-8))."""
    rewards = [[1.0, 0.0, 0.5, 0.2], [0.3, 0.9, 0.9, 0.0], [0.7, 0.1, 0.4, 0.6]]
    batch = batch_of(rewards, n_response=_length)
    scores_T = torch.cat([
        torch.full((_length(g, i),), r - sum(row) / len(row), dtype=torch.float64)
        for g, row in enumerate(rewards) for i, r in enumerate(row)
    ])  # fmt: skip
    whitened_T = (scores_T - scores_T.mean()) * torch.rsqrt(scores_T.var() + 1e-8)
    starts = torch.cumsum(torch.tensor([0] + [_length(g, i) for g in range(3) for i in range(4)]),
                          0)[:-1]  # fmt: skip
    expected = whitened_T[starts].tolist()

    default = [e.advantage for e in build_examples(batch, reinforce_pp(), share_prompts=False)]
    assert default == pytest.approx(expected, rel=1e-5, abs=1e-6)
    per_sequence = build_examples(batch, reinforce_pp(whiten="sequence"), share_prompts=False)
    assert [e.advantage for e in per_sequence] != pytest.approx(expected, rel=1e-2)


# ----- (b) rewards equal up to float noise --------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_a_group_whose_rewards_differ_by_float_noise_gets_no_advantage(estimator):
    """A 1e-7 spread (a reward computed two ways, float sums) gave GRPO advantages of 0.112:
    it is no signal, as for DAPO's group filter, which drops the same group. A real spread
    keeps GRPO's advantage, (r - mean) / (std + 1e-6), computed here independently."""
    noise = [0.3, 0.3 + 1e-7, 0.3, 0.3 - 1e-7, 0.3, 0.3 + 2e-7, 0.3, 0.3]
    real = [0.0, 1.0, 0.5, 0.5, 0.25, 1.0, 0.0, 0.75]
    rewards_GN = torch.tensor([noise, real])
    algorithm = AlgorithmConfig(advantage=estimator)
    advantages_GN = compute_advantages(algorithm, rewards_GN, n_tokens_GN=torch.ones(2, 8))
    assert advantages_GN[0].tolist() == [0.0] * 8
    assert advantages_GN[1].abs().max() >= 0.5
    group = batch_of([noise, real]).groups
    assert [keep_if_reward_varies(g) for g in group] == [False, True]
    if estimator == "grpo":
        r = torch.tensor(real, dtype=torch.float64)
        expected = (r - r.mean()) / (r.std() + 1e-6)
        assert advantages_GN[1].tolist() == pytest.approx(expected.tolist(), rel=1e-5)


# ----- (c) DAPO's overlong penalty for an episode cut at its budget -------------------------------


async def test_dapo_gives_the_full_overlong_penalty_to_a_tool_episode_cut_at_its_budget(
    local_engine, tiny_tokenizer
):
    """A real tool episode (local engine) that calls the calculator every turn until the
    episode's 40-token budget is spent: the tool results fill part of the budget, so the
    model sampled fewer than the ramp's start, which gave it 0. DAPO gives a response cut at
    its budget the full penalty, and so does this episode; one that ends by itself within
    the budget is not punished."""
    from rollouts.chat_turns import ChatTurns
    from rollouts.envs import ToolEnv, math_grader
    from rollouts.multiturn import MultiTurnConfig, run_episode
    from rollouts.tools import calculator_tool
    from tests.test_multiturn import CALC, make_ctx, make_prompt, scripted

    _, engine = local_engine
    tok = tiny_tokenizer
    tools = [calculator_tool()]
    budget, algorithm = 40, dapo(max_response_len=40, cache_len=8)  # ramp from 32 tokens
    env = ToolEnv(make_prompt(tok, tools), tools, math_grader, lambda text: [CALC])
    cut = await run_episode(env, make_ctx(engine, tok), ChatTurns.from_tokenizer(tok),
                            config=MultiTurnConfig(max_turns=10, max_response_tokens=budget))  # fmt: skip
    assert cut.status == "truncated" and 0 in cut.loss_mask  # cut, with tool tokens
    assert cut.num_trained_tokens <= budget - 8  # the ramp alone: no penalty
    assert shape_reward(algorithm, lambda s: 1.0)(cut)["overlong"] == -1.0

    env = ToolEnv(make_prompt(tok, tools), tools, math_grader, scripted([CALC]))
    ended = await run_episode(env, make_ctx(engine, tok), ChatTurns.from_tokenizer(tok),
                              config=MultiTurnConfig(max_turns=10, max_response_tokens=budget))  # fmt: skip
    assert ended.status == "completed" and 0 in ended.loss_mask
    assert shape_reward(algorithm, lambda s: 1.0)(ended)["overlong"] == 0.0


# ----- (d) truncated importance sampling off-policy -------------------------------------------


async def test_is_cap_weights_the_off_policy_gradient_by_truncated_importance_sampling(
    tiny_model_dir, tmp_path
):
    """Engine logprobs that differ from the trainer's, old_from_rollout (the overlap/async
    modes): with is_cap, each token's gradient is weighted by min(π_trainer / π_engine, cap)
    (the ratio is to the trainer's logprobs), and tis_* metrics say how much; computed here
    with autograd on a plain copy of the model. Before, is_cap did nothing in these modes."""
    import math
    from dataclasses import replace

    from tests.rl_helpers import grads_of, rl_backend
    from training.backend.pytorch import load_model_and_tokenizer
    from training.rl.algorithms import grpo
    from training.rl.batch import loss_weight_fn, rl_loss_fn
    from training.rl.step import train_on_batch

    cap = 1.5
    algorithm = grpo(is_cap=cap, aggregation="token-mean")
    batch = batch_of([[1.0, 0.0, 0.5, 0.2], [0.3, 0.9, 0.0, 0.6]], n_response=_length)
    with rl_backend(tiny_model_dir, tmp_path) as backend:
        examples = build_examples(batch, algorithm, share_prompts=False)
        trainer_S = await backend.compute_logprobs(examples).result()
        offset = [[math.sin(3.1 * j + k) for k in range(len(lp))] for j, lp in enumerate(trainer_S)]
        engine_S = iter([(lp + torch.tensor(off)).tolist() for lp, off in zip(trainer_S, offset,
                                                                              strict=True)])  # fmt: skip
        groups = tuple(tuple(replace(s, rollout_logprobs=tuple(next(engine_S))) for s in group)
                       for group in batch.groups)  # fmt: skip
        batch = replace(batch, groups=groups)
        examples = build_examples(batch, algorithm, share_prompts=False)
        fut = backend.forward_backward(examples, loss_fn=rl_loss_fn(algorithm, old_from_rollout=True),
                                       loss_weight_fn=loss_weight_fn(algorithm), dropout=False)  # fmt: skip
        metrics = await fut.result()
        grads = await grads_of(backend)
        await backend.optim_step().result()  # (drops those gradients)
        # two updates: the second one's ratio is to the trainer's logprobs before the first
        moved = await train_on_batch(backend, batch, algorithm, temperature=1.0,
                                     old_from_rollout=True, reference=None, mini_batches=2)  # fmt: skip
    assert moved["kl_to_old_last"] > 0 and moved["n_updates"] == 2

    model = load_model_and_tokenizer(tiny_model_dir)[0].eval()
    loss, weights = 0.0, []
    n_tokens = sum(len(off) for off in offset)
    for example, off in zip(examples, offset, strict=True):
        ids = torch.tensor([example.input_ids])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        n_prompt = len(example.input_ids) - len(off)
        lp = torch.stack(
            [logprobs[n_prompt + k - 1, ids[0, n_prompt + k]] for k in range(len(off))]
        )
        w = torch.exp(-torch.tensor(off)).clamp(max=cap)  # π_trainer / π_engine = e^(−offset)
        weights.append(w)
        loss = loss - (w * example.advantage * lp).sum() / n_tokens
    loss.backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    flat = torch.cat([grads[n].flatten() for n in expected])
    flat_expected = torch.cat([g.flatten() for g in expected.values()])
    torch.testing.assert_close(
        flat, flat_expected, rtol=1e-4, atol=1e-4 * flat_expected.abs().max()
    )
    all_w = torch.cat(weights)
    assert metrics["tis_weight_mean"] == pytest.approx(all_w.mean().item(), rel=1e-5)
    assert metrics["tis_capped_fraction"] == pytest.approx((all_w >= cap).float().mean().item())
    assert 0 < metrics["tis_capped_fraction"] < 1
