"""Each extension point of the RL loop is a plain callable that is actually called and changes
the result: reward, advantage, policy loss, KL, reference update, logger, stop condition,
checkpoint hook (and the rollout dump through `on_batch`); and the recipe passes them on.

The loop runs for real and cheaply: the in-process local engine over loopback HTTP, the tiny
model, 2 prompts × 2 samples of at most 4 tokens, 1-2 steps.
"""

from __future__ import annotations

import pytest
import torch

from rollouts.rewards import vector_reward, weighted_sum
from rollouts.shaping import add_shaping, length_bonus
from tests.rl_helpers import index_reward, run_loop
from training.loops.hooks import RLHooks
from training.recipes.rl import RLExtensions, run_rl_recipe
from training.rl.advantages import grpo_advantages
from training.rl.algorithms import compute_policy_loss, grpo
from training.rl.kl import kl_estimate
from training.rl.reference import reset_to_policy
from training.rl.rollout_dump import RolloutDumpWriter, read_rollout_dump
from training.rl_config import RLRunConfig


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


async def test_custom_reward_scores_every_sample_and_its_components_reach_the_metrics(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    scored = []

    def index(sample) -> float:
        scored.append(sample)
        return index_reward(sample)

    reward = vector_reward({"index": index, "format": lambda s: 0.5},
                           weighted_sum({"index": 1.0, "format": 2.0}))  # fmt: skip
    run = await run_loop(engine, tiny_model_dir, tmp_path, reward_fn=reward)
    (metrics,) = run.history
    assert len(scored) == 4  # 2 groups × 2 samples
    assert metrics["reward/index"] == pytest.approx(0.5)
    assert metrics["reward/format"] == pytest.approx(0.5)
    assert metrics["reward_mean"] == pytest.approx(0.5 + 2 * 0.5)


async def test_custom_advantage_fn_replaces_the_estimator(local_engine, tiny_model_dir, tmp_path):
    _, engine = local_engine
    seen = []

    def no_signal(rewards_GN: torch.Tensor) -> torch.Tensor:
        seen.append(rewards_GN.clone())
        return torch.zeros_like(rewards_GN)

    run = await run_loop(engine, tiny_model_dir, tmp_path, advantage_fn=no_signal)
    (rewards_GN,) = seen
    assert rewards_GN.tolist() == [[0.0, 1.0], [0.0, 1.0]]
    assert grpo_advantages(rewards_GN).abs().min() > 0.5  # what GRPO would have trained on
    assert run.history[0]["grad_norm"] == 0.0  # zero advantages: no policy gradient at all


async def test_custom_policy_loss_fn_is_the_loss_that_is_trained(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    calls = []

    def loss_with_bonus(config, logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, **kw):
        calls.append(config.name)
        loss, metrics = compute_policy_loss(
            config, logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, **kw
        )
        return loss + 10.0, {**metrics, "bonus": 10.0}

    run = await run_loop(engine, tiny_model_dir, tmp_path, policy_loss_fn=loss_with_bonus)
    (metrics,) = run.history
    assert calls and set(calls) == {"grpo"}
    assert metrics["bonus"] == 10.0
    assert metrics["loss"] == pytest.approx(metrics["policy_loss"] + 10.0, abs=1e-5)


async def test_custom_kl_fn_changes_the_logged_kl_and_the_loss(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    calls = []

    def shifted_k3(logprobs_BT, ref_logprobs_BT, mask_BT):
        calls.append(mask_BT.shape)
        return kl_estimate(logprobs_BT, ref_logprobs_BT, "k3", mask_BT=mask_BT) + 0.5 * mask_BT

    run = await run_loop(engine, tiny_model_dir, tmp_path, algorithm=grpo(kl_coef=0.1),
                         with_reference=True, kl_fn=shifted_k3)  # fmt: skip
    (metrics,) = run.history
    assert calls
    # at step 1 the reference is the policy: plain k3 would log ~0
    assert metrics["kl"] == pytest.approx(0.5, abs=1e-3)
    assert metrics["loss"] == pytest.approx(metrics["policy_loss"] + 0.1 * metrics["kl"], abs=1e-5)


async def test_custom_reference_update_sees_each_steps_kl_and_logs_its_metrics(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    seen = []

    def follow_policy(reference, policy, step, metrics):
        seen.append((step, metrics["kl"]))
        reset_to_policy(reference, policy)
        return {"reference_followed": 1.0}

    run = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=2,
                         algorithm=grpo(kl_coef=0.1), with_reference=True,
                         reference_update=follow_policy)  # fmt: skip
    assert [step for step, _ in seen] == [1, 2]
    assert all(kl >= 0 for _, kl in seen)
    assert [m["reference_followed"] for m in run.history] == [1.0, 1.0]
    assert run.history[-1]["grad_norm"] > 0  # the policy moved, and the reference followed
    assert same_weights(run.reference.model, run.backend.model)


async def test_custom_logger_receives_every_step(local_engine, tiny_model_dir, tmp_path):
    _, engine = local_engine
    logged = []
    run = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=2,
                         hooks=RLHooks(logger=lambda step, m: logged.append((step, m))))  # fmt: skip
    assert [step for step, _ in logged] == [1, 2]
    assert [m for _, m in logged] == run.history
    assert all("loss" in m and "reward_mean" in m for _, m in logged)


async def test_stop_fn_ends_the_run_after_its_step_with_a_checkpoint(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    asked = []

    def stop_at_two(step, metrics) -> bool:
        asked.append(step)
        return step == 2

    run = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=5, checkpoint_every=10,
                         hooks=RLHooks(stop_fn=stop_at_two))  # fmt: skip
    assert asked == [1, 2] and len(run.history) == 2 and run.backend.step == 2
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"


async def test_checkpoint_hook_is_called_with_each_written_checkpoint(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    hooked = []

    def hook(step, path, metrics):
        hooked.append((step, path.name, (path / "trainer_state.json").is_file(), metrics))

    run = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=2, checkpoint_every=1,
                         hooks=RLHooks(checkpoint_hook=hook))  # fmt: skip
    assert [h[:3] for h in hooked] == [(1, "step_000001", True), (2, "step_000002", True)]
    assert [h[3] for h in hooked] == run.history


async def test_on_batch_dump_holds_each_step_batch_as_trained(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    dump = RolloutDumpWriter(tmp_path / "rollouts.jsonl")
    run = await run_loop(
        engine, tiny_model_dir, tmp_path, max_steps=2, hooks=RLHooks(on_batch=dump)
    )
    dump.close()
    batches = read_rollout_dump(tmp_path / "rollouts.jsonl")
    assert sorted(batches) == [1, 2]
    for step, metrics in enumerate(run.history, 1):
        samples = batches[step].samples
        assert len(samples) == 4 and all(s.rollout_logprobs for s in samples)
        assert metrics["reward_mean"] == pytest.approx(sum(s.reward for s in samples) / 4)


async def test_recipe_passes_its_extensions_and_dumps_rollouts_when_configured(
    local_engine, tiny_model_dir, tmp_path
):
    server, _ = local_engine
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}", "answer": "{2 * i}"}}\n' for i in range(8)))
    config = RLRunConfig.model_validate({
        "output_dir": str(tmp_path / "run"), "sft_config": None,
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_path": str(data), "task": None},
        "engines": {"urls": [server.url]},
        "rollout": {"batch_size": 2, "n_samples_per_prompt": 2, "filter_groups": "none",
                    "sampling": {"max_new_tokens": 4}},
        "train": {"max_steps": 3, "checkpoint_every": 10, "eval_samples": 0,
                  "dump_rollouts": True},
        "backend": {"num_threads": 1},
    })  # fmt: skip
    hooked = []
    extensions = RLExtensions(
        reward_fn=index_reward,
        transforms=(add_shaping("length", length_bonus(0.01)),),
        stop_fn=lambda step, metrics: step == 2,
        checkpoint_hook=lambda step, path, metrics: hooked.append((step, path.name)),
    )
    summary = await run_rl_recipe(config, extensions=extensions)
    assert summary.steps == 2 and hooked == [(2, "step_000002")]
    batches = read_rollout_dump(tmp_path / "run" / "rollouts.jsonl")
    assert sorted(batches) == [1, 2]
    for sample in batches[1].samples:
        length = 0.01 * sample.num_trained_tokens
        assert sample.reward_components == pytest.approx(
            {"task": sample.index_in_group, "length": length}
        )


# ----- `module:function` references: where their modules are found -----------------------------


def write_module(folder, name: str, answer: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(f"def reverse_reward(sample):\n    return {answer!r}\n")


@pytest.fixture
def isolated_imports(monkeypatch):
    """sys.path restored after the test, and the test's modules forgotten (names it yields)."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    names: list[str] = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


def test_a_reward_module_in_the_cwd_or_beside_the_config_resolves_without_pythonpath(
    tmp_path, monkeypatch, isolated_imports
):
    import sys

    from training.recipes.callables import resolve_callable

    work, conf = tmp_path.resolve() / "work", tmp_path.resolve() / "conf"
    write_module(conf, "conf_only_reward", "conf")
    write_module(work, "cwd_only_reward", "cwd")
    write_module(conf, "both_reward", "conf")
    write_module(work, "both_reward", "cwd")
    isolated_imports += ["conf_only_reward", "cwd_only_reward", "both_reward"]
    monkeypatch.chdir(work)
    before = list(sys.path)
    assert resolve_callable("conf_only_reward:reverse_reward", config_dir=conf)(None) == "conf"
    assert resolve_callable("cwd_only_reward:reverse_reward")(None) == "cwd"
    assert resolve_callable("both_reward:reverse_reward", config_dir=conf)(None) == "cwd"
    # only the folders that held a module were added to the import path
    assert sorted(set(sys.path) - set(before)) == sorted({str(conf), str(work)})


def test_an_unresolved_reference_says_where_it_looked_and_how_to_fix_it(
    tmp_path, monkeypatch, isolated_imports
):
    import sys

    from plumbing.errors import ConfigError
    from training.recipes.callables import resolve_callable

    work, conf = tmp_path.resolve() / "work", tmp_path.resolve() / "conf"
    work.mkdir()
    conf.mkdir()
    monkeypatch.chdir(work)
    before = list(sys.path)
    with pytest.raises(ConfigError) as err:
        resolve_callable("myreward:reverse_reward", config_dir=conf)
    assert f"the working directory ({work}) or config file's directory ({conf})" in str(err.value)
    assert ("put myreward.py in the working directory or next to the config, or add its folder "
            "to PYTHONPATH") in str(err.value)  # fmt: skip
    assert sys.path == before  # nothing added where nothing was found
    write_module(conf, "myreward", "conf")
    isolated_imports.append("myreward")
    with pytest.raises(ConfigError, match=r"module myreward \(.*conf/myreward.py\) has no 'nope'"):
        resolve_callable("myreward:nope", config_dir=conf)


def test_rollouts_rl_finds_a_reward_module_beside_its_config_from_another_cwd(
    tmp_path, tiny_model_dir
):
    from tests.test_cli import assert_error_only, rollouts

    work, conf = tmp_path / "work", tmp_path / "conf"
    work.mkdir()
    conf.mkdir()
    (conf / "cfgreward.py").write_text("print('imported cfgreward beside the config')\n")
    config = conf / "rl.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nmodel:\n  path: {tiny_model_dir}\n"
                      "reward:\n  fn: cfgreward:reverse_reward\n")  # fmt: skip
    proc = rollouts("rl", "--config", str(config), cwd=work)
    assert "imported cfgreward beside the config" in proc.stdout
    assert_error_only(proc, f"module cfgreward ({conf / 'cfgreward.py'}) has no 'reverse_reward'")
