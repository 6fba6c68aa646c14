"""The algorithm reaches the rollout side wherever it is used, and schedules are as the seeds
have them: several switches with overrides in YAML, and schedules that see the last step's
metrics. The loop runs for real (in-process engine, tiny model)."""

from __future__ import annotations

import pytest

from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.errors import ConfigError
from tests.rl_helpers import run_loop
from training.config import load_config
from training.loops.hooks import RLHooks
from training.recipes.rl import algorithm_schedule
from training.rl.algorithms import dapo, grpo
from training.rl_config import RLRunConfig


def varies_on_prompt_zero_only(sample) -> float:
    """A reward spread only in the group of prompt "0+0" (answer "0"); every other group ties."""
    return float(sample.index_in_group) if sample.metadata["answer"] == "0" else 1.0


async def test_dapo_through_the_library_shapes_rewards_and_filters_groups(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    batches = []
    # batch_size 2, launch cap 8 = the 8 prompts: one group varies, the 7 others tie
    rollout = RolloutConfig(batch_size=2, n_samples_per_prompt=2,
                            sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    run = await run_loop(engine, tiny_model_dir, tmp_path, rollout=rollout,
                         algorithm=dapo(max_response_len=64), reward_fn=varies_on_prompt_zero_only,
                         hooks=RLHooks(on_batch=lambda step, b: batches.append(b)))  # fmt: skip
    (batch,) = batches
    assert batch.metrics["groups_filtered"] == 7  # dynamic sampling
    assert len(batch.groups) == 1
    assert all("overlong" in s.reward_components for s in batch.samples)  # overlong shaping
    assert run.history[0]["algorithm"] == "dapo"


async def test_a_schedule_sees_the_last_steps_metrics_and_the_rollout_side_follows_it(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    seen = []

    def by_reward(step, metrics):
        seen.append((step, dict(metrics)))
        if "reward_mean" in metrics:  # from step 2 on: the previous step's metrics are known
            return dapo(max_response_len=64)
        return grpo()

    run = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=2, schedule=by_reward)
    assert seen[0] == (1, {})
    assert seen[1][0] == 2 and seen[1][1]["reward_mean"] == run.history[0]["reward_mean"]
    assert [m["algorithm"] for m in run.history] == ["grpo", "dapo"]
    assert run.manager.reward_fn is not run.manager.task_reward  # overlong shaping from step 2


def test_several_switches_with_overrides_from_yaml(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text(
        "algorithm:\n"
        "  preset: grpo\n"
        "  overrides: {kl_coef: 0.2}\n"
        "  switches:\n"
        "    - {at_step: 30, preset: grpo, overrides: {kl_coef: 0.05}}\n"
        "    - {at_step: 60, preset: dapo, overrides: {clip_high: 0.3}}\n"
    )
    schedule = algorithm_schedule(load_config(RLRunConfig, path).algorithm, budget=16)
    phases = [schedule(s, {}) for s in (1, 29, 30, 59, 60, 500)]
    assert [(a.name, a.kl_coef) for a in phases[:4]] == [("grpo", 0.2), ("grpo", 0.2),
                                                         ("grpo", 0.05), ("grpo", 0.05)]  # fmt: skip
    assert phases[4].name == "dapo" and phases[4].clip_high == 0.3
    assert phases[4].overlong.max_response_len == 16  # the generation budget
    assert phases[5] is phases[4]


def test_switches_out_of_order_are_a_config_error_naming_the_field(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text(
        "algorithm:\n  switches:\n    - {at_step: 60, preset: dapo}\n    - {at_step: 30, preset: gspo}\n"
    )
    with pytest.raises(ConfigError, match="at_step must increase"):
        load_config(RLRunConfig, path)
