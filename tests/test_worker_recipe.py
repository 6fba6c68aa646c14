"""`rollout.workers` in the RL recipe: a run's rollouts come from worker processes that import
the configured reward themselves; what workers cannot run yet is refused naming the setting."""

from __future__ import annotations

import json

import pytest

from engines import SGLangEngine
from plumbing.errors import ConfigError
from rollouts.prompts import PromptItem
from tests.rl_helpers import index_reward
from training.config import load_config
from training.data.buffer import DataBuffer
from training.recipes.rl import RLExtensions, run_rl_recipe
from training.recipes.rl_manager import build_rollout_manager
from training.rl.rollout_dump import read_rollout_dump
from training.rl_config import RLRunConfig


def _config(tmp_path, tiny_model_dir, urls, **rollout) -> RLRunConfig:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}", "answer": "{2 * i}"}}\n' for i in range(8)))
    return RLRunConfig.model_validate({
        "output_dir": str(tmp_path / "run"), "sft_config": None,
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_path": str(data), "task": None},
        "engines": {"urls": urls},
        "reward": {"fn": "my_worker_reward:length_reward"},
        "rollout": {"batch_size": 2, "n_samples_per_prompt": 2, "filter_groups": "none",
                    "sampling": {"max_new_tokens": 4}, "workers": 2, **rollout},
        "train": {"max_steps": 2, "checkpoint_every": 10, "eval_samples": 0,
                  "dump_rollouts": True},
        "backend": {"num_threads": 1},
    })  # fmt: skip


async def test_a_recipe_run_with_two_workers_trains_rewards_the_workers_computed(
    local_engine, tiny_model_dir, tmp_path, monkeypatch
):
    server, _ = local_engine
    rewards = tmp_path / "rewards"  # importable here only through sys.path, as resolve_callable
    rewards.mkdir()  # leaves a module next to a config: the workers must find it too
    (rewards / "my_worker_reward.py").write_text(
        "def length_reward(sample):\n    return 10.0 * sample.index_in_group + len(sample.response_ids)\n"
    )
    monkeypatch.syspath_prepend(str(rewards))
    summary = await run_rl_recipe(_config(tmp_path, tiny_model_dir, [server.url, server.url]))
    assert summary.steps == 2
    batches = read_rollout_dump(tmp_path / "run" / "rollouts.jsonl")
    assert sorted(batches) == [1, 2]
    for batch in batches.values():
        assert len(batch.groups) == 2
        for s in batch.samples:
            assert s.reward == 10.0 * s.index_in_group + len(s.response_ids)
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["workers/restarts"] for r in rows if "workers/restarts" in r] == [0.0, 0.0]


async def test_a_python_reward_object_is_refused_with_workers(tiny_model_dir, tmp_path):
    config = _config(tmp_path, tiny_model_dir, ["http://127.0.0.1:9", "http://127.0.0.1:9"])
    with pytest.raises(ConfigError, match=r"rollout.workers=2: a reward given as a Python object"):
        await run_rl_recipe(config, extensions=RLExtensions(reward_fn=index_reward))


@pytest.mark.parametrize(("override", "named"), [
    ("engines.pause_mode=in_place", "engines.pause_mode=in_place: a worker's requests keep"),
    ("env.kind=tools", "env.kind=tools: a worker runs single-turn episodes only"),
    ("engines.router_url=http://127.0.0.1:9", "engines.router_url: each worker drives a slice"),
    ("rollout.worker_timeout=3", "unknown key 'rollout.worker_timeout'"),
])  # fmt: skip
def test_what_workers_cannot_run_is_refused_naming_the_setting(tmp_path, override, named):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  workers: 2\n")
    with pytest.raises(ConfigError, match=named):
        load_config(RLRunConfig, path, [override])


def test_an_unknown_worker_key_in_a_file_is_named_with_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  workers: 2\n  worker_restart: 1\n")
    with pytest.raises(ConfigError, match=r"run.yaml.*unknown key 'rollout.worker_restart'"):
        load_config(RLRunConfig, path)


def test_a_recipes_workers_get_the_runs_engine_settings_and_the_trainers_pauses(
    tiny_model_dir, tmp_path
):
    """The recipe's worker manager starts each worker with the run's `engines.*` (what its
    clients and pool are built from) and tells it which engines the trainer's clients paused."""
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    config = _config(tmp_path, tiny_model_dir, urls)
    engines = config.engines.model_copy(
        update={"generate_timeout_s": 7.0, "stall_floor_s": 3.0, "api_key": "k"}
    )
    config = config.model_copy(update={"engines": engines})
    clients = [SGLangEngine(u) for u in urls]
    manager = build_rollout_manager(config, None, clients, DataBuffer([PromptItem((1, 2), (), {})], seed=0), reward_fn=None,
                                    extensions=RLExtensions(), episodes=None, backend=None,
                                    tokenizer=None)  # fmt: skip
    settings = [w.start_frame["engines"] for w in manager.workers]
    assert [s["generate_timeout_s"] for s in settings] == [7.0, 7.0]
    assert [(s["stall_floor_s"], s["stall_s_per_token"], s["api_key"]) for s in settings] == [
        (3.0, config.engines.stall_s_per_token, "k")] * 2  # fmt: skip
    clients[1].paused = True  # the trainer's push paused engine 1 (worker 1's)
    assert [manager._paused_of(w) for w in manager.workers] == [[], [urls[1]]]
