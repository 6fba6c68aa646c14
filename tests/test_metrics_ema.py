"""EMA metrics: `reward_mean_ema` is the hand-computed exponential moving average of the step
rewards, and a resumed run continues it from its checkpoint instead of starting over."""

from __future__ import annotations

import pytest

from engines import SGLangEngine
from engines.local import open_local_engine
from tests.rl_helpers import run_loop
from training.loops.ema import ema_metrics


def hand_ema(values, decay):
    out, ema = [], None
    for v in values:
        ema = v if ema is None else decay * ema + (1 - decay) * v
        out.append(ema)
    return out


def test_ema_metrics_match_a_hand_computed_ema_and_carry_over_missing_steps():
    rewards = [0.0, 1.0, 0.5, 0.25, 1.0]
    previous, got = {}, []
    for r in rewards:
        previous = {"reward_mean": r} | ema_metrics(previous, {"reward_mean": r},
                                                    ["reward_mean"], 0.8)  # fmt: skip
        got.append(previous["reward_mean_ema"])
    assert got == pytest.approx(hand_ema(rewards, 0.8))
    assert ema_metrics(previous, {"loss": 1.0}, ["reward_mean"], 0.8) == {
        "reward_mean_ema": got[-1]  # a step without the metric keeps the EMA
    }
    assert ema_metrics({}, {"algorithm": "grpo"}, ["algorithm"], 0.8) == {}  # not a number


def first_token_reward(sample) -> float:
    """Varies with what was sampled, so the step means differ and the EMA has work to do."""
    return float(sample.response_ids[0] % 5) if sample.response_ids else 0.0


async def test_the_loop_logs_the_ema_and_resume_continues_it(tiny_model_dir, tmp_path):
    loop = {"ema_decay": 0.5}
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as server,
        SGLangEngine(server.url) as engine,
    ):
        first = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=2,
                               checkpoint_every=2, reward_fn=first_token_reward, loop=loop)  # fmt: skip
        resumed = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=4,
                                 checkpoint_every=2, reward_fn=first_token_reward,
                                 loop=loop | {"resume": "auto"})  # fmt: skip
    history = first.history + resumed.history
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    rewards = [m["reward_mean"] for m in history]
    assert len(set(rewards)) > 1  # otherwise any EMA would pass
    assert [m["reward_mean_ema"] for m in history] == pytest.approx(hand_ema(rewards, 0.5))
