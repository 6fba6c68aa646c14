"""The RL recipe with `env.kind: tools`: multi-turn episodes for training and for evaluation."""

from __future__ import annotations

import json

from training.config import load_config
from training.recipes.rl import resolve_callable, run_rl_recipe
from training.recipes.rl_env import build_episode_setup, build_tools
from training.rl_config import RLRunConfig


def test_env_section_builds_the_configured_tools_and_reward():
    config = load_config(RLRunConfig, None, ["env.kind=tools", "env.tools=[calculator,python]",
                                             "env.tool_timeout_s=3"])  # fmt: skip
    tools = build_tools(config.env)
    assert [t.name for t in tools] == ["calculator", "python"]
    assert all(t.timeout_s == 3 for t in tools)
    setup = build_episode_setup(config.env, config.reward, resolve=resolve_callable)
    assert setup.reward_fn.__name__ == "env_reward"  # the env grades; no reward.fn was named
    named = load_config(RLRunConfig, None, ["env.kind=tools",
                                            "reward.fn=rollouts.tasks.arithmetic:correctness_reward"])  # fmt: skip
    assert build_episode_setup(named.env, named.reward,
                               resolve=resolve_callable).reward_fn.__name__ == "correctness_reward"  # fmt: skip


async def test_tool_env_runs_through_rollouts_and_evaluation(tiny_model_dir, tmp_path):
    config = load_config(RLRunConfig, None, [
        f"output_dir={tmp_path / 'out'}", f"model.path={tiny_model_dir}", "data.task=multiply",
        f"data.task_dir={tmp_path / 'data'}", "data.multiply.n_sft=4", "data.multiply.n_rl=16",
        "data.multiply.n_eval=4", "env.kind=tools", "env.show_specs=false", "env.max_turns=2",
        "env.max_response_tokens=24", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.filter_groups=none", "rollout.sampling.max_new_tokens=8", "train.max_steps=1",
        "train.eval_samples=4", "train.eval_max_new_tokens=8", "backend.num_threads=1",
    ])  # fmt: skip
    summary = await run_rl_recipe(config)
    row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary.steps == 1 and summary.accuracy_before is not None
    for key in ("turns_per_sample", "tool_calls_per_sample", "eval_tool_calls_per_sample",
                "eval_turns_per_sample", "reward/correct"):  # fmt: skip
        assert key in row, key


async def test_the_sft_checkpoint_is_reused_only_if_made_with_the_same_config_and_data(tmp_path):
    from training.config import SFTRunConfig, config_to_yaml
    from training.recipes.rl import _saved_config, resolve_start_model, sft_checkpoint_mismatch
    from training.recipes.sft import sft_data_files

    sft = load_config(SFTRunConfig, None, [
        f"output_dir={tmp_path / 'sft'}", "train.max_steps=5", f"data.task_dir={tmp_path / 'd'}",
        "data.arithmetic.n_sft=20", "data.arithmetic.n_rl=10", "data.arithmetic.n_eval=10",
    ])  # fmt: skip
    step = tmp_path / "sft" / "checkpoints" / "step_000005"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("step_000005")
    saved = sft.model_dump(mode="json")
    del saved["data"]["multiply"]  # a config saved before a field existed: defaults fill it
    fingerprint = sft_data_files(sft).fingerprint()
    extra = {"config": saved, "data_sha256": fingerprint}
    state = {"step": 5, "weight_version": 5, "metrics": {}, "extra": extra}
    (step / "trainer_state.json").write_text(json.dumps(state))
    (step / "config.json").write_text("{}")  # its HF export, as every checkpoint has one
    (tmp_path / "sft.yaml").write_text(config_to_yaml(sft))
    rl = load_config(RLRunConfig, None, [f"sft_config={tmp_path / 'sft.yaml'}"])
    assert await resolve_start_model(rl) == str(step)

    assert _saved_config(step) == sft
    assert _saved_config(step) != sft.model_copy(update={"optim": sft.optim.model_copy(
        update={"lr": 0.5})})  # fmt: skip
    assert _saved_config(tmp_path / "nowhere") is None
    assert sft_checkpoint_mismatch(step, sft) is None
    longer = sft.model_copy(update={"train": sft.train.model_copy(update={"max_steps": 6})})
    assert sft_checkpoint_mismatch(step, longer) == "is unfinished"
    # same config as saved, other data files (e.g. from a new version of the task generator)
    other = load_config(SFTRunConfig, None, [
        f"output_dir={tmp_path / 'sft'}", "train.max_steps=5", f"data.task_dir={tmp_path / 'd'}",
        "data.arithmetic.n_sft=21", "data.arithmetic.n_rl=10", "data.arithmetic.n_eval=10",
    ])  # fmt: skip
    assert sft_data_files(other).fingerprint() != fingerprint
    state["extra"]["config"] = other.model_dump(mode="json")
    (step / "trainer_state.json").write_text(json.dumps(state))
    assert sft_checkpoint_mismatch(step, other) == "was trained on other data"


async def test_the_agent_example_trains_through_the_proxy_in_the_rl_recipe(
    tiny_model_dir, tmp_path
):
    """examples/agent_rl.py's agent (the `openai` client alone) in the recipe it runs, small."""
    import runpy

    from tests.distributed_launch import ROOT
    from training.recipes.rl import RLExtensions

    example = runpy.run_path(str(ROOT / "examples" / "agent_rl.py"))  # not as __main__
    config = load_config(RLRunConfig, ROOT / "configs" / "agent_tiny.yaml", [
        f"output_dir={tmp_path / 'out'}", f"model.path={tiny_model_dir}",
        f"data.task_dir={tmp_path / 'data'}", "data.multiply.n_sft=4", "data.multiply.n_rl=16",
        "data.multiply.n_eval=4", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.filter_groups=none", "rollout.sampling.max_new_tokens=8", "train.max_steps=2",
        "train.eval_samples=4", "train.eval_max_new_tokens=8",
    ])  # fmt: skip
    clients = []

    async def agent(client, task):
        clients.append(type(client).__name__)
        return await example["calculator_agent"](client, task)

    summary = await run_rl_recipe(config, extensions=RLExtensions(agent=agent))
    rows = [json.loads(r) for r in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert summary.steps == 2 and [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == [1, 2]
    assert all(r["samples_failed"] == 0 for r in rows), rows  # every session ran to its reward
    assert len(clients) >= 2 * 2 * 2 and set(clients) == {"AsyncOpenAI"}  # each a session
    calculate = example["calculate"]
    assert calculate("12*3") == "36" and calculate("__import__('os')").startswith("Error")
