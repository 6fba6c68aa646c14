"""run_rl_training end to end against a local engine on loopback HTTP, real weights: served
from this test's process for the three steps (no ~3.5 CPU s of an engine process's imports), a
launched engine process for cancellation, which must leave no process behind."""

from __future__ import annotations

import json
import os

import pytest
import trio

from engines import EnginePool, SGLangEngine, WeightSyncError, launch_engine
from engines.local import open_local_engine
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import load_prompt_jsonl
from rollouts.tasks.arithmetic import digit_share_reward, write_arithmetic_datasets
from training.backend.checkpoint import find_latest_checkpoint
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.data.buffer import DataBuffer
from training.loops.hooks import RLHooks
from training.loops.loggers import JsonlLogger
from training.loops.rl import run_rl_training
from training.rl.algorithms import grpo
from training.rl.batch import collate_rl
from training.rl.objective import RLObjective
from training.rl_config import RLLoopConfig


class BadPathEngine(SGLangEngine):
    """A real engine client that asks the server to load from a path that does not exist."""

    async def update_weights_from_disk(self, model_path, weight_version=None, **kw):
        return await super().update_weights_from_disk(f"{model_path}-missing", weight_version, **kw)


async def test_three_rl_steps_advance_engine_version_and_change_its_outputs(
    tiny_model_dir, tmp_path
):
    files = write_arithmetic_datasets(tmp_path / "data", n_sft=10, n_rl=64, n_eval=8, seed=0)
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    prompts = load_prompt_jsonl(files.rl_train, tok)
    buffer = DataBuffer(prompts, seed=0)
    backend = PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=3e-3, schedule="constant"), max_steps=3,
        checkpoint_dir=tmp_path / "out" / "checkpoints", pack_length=None,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip
    rollout = RolloutConfig(batch_size=4, n_samples_per_prompt=4, filter_groups="none",
                            sampling=SamplingConfig(max_new_tokens=6))  # fmt: skip
    probe = [*prompts[0].prompt_ids, 17, 18, 19]
    logger = JsonlLogger(tmp_path / "out" / "metrics.jsonl")
    with backend:
        async with (
            open_local_engine(tiny_model_dir, weight_version="0", num_threads=1) as server,
            SGLangEngine(server.url) as engine,
            EnginePool([engine]) as pool,
        ):
            before = await engine.score(probe, len(prompts[0].prompt_ids))
            manager = AsyncRolloutManager(pool, buffer, rollout, reward_fn=digit_share_reward,
                                          current_version=lambda: backend.weight_version)  # fmt: skip
            history = await run_rl_training(
                backend, buffer, manager, [engine],
                RLLoopConfig(max_steps=3, checkpoint_every=3), objective=RLObjective(grpo()),
                export_dir=tmp_path / "out" / "weights", hooks=RLHooks(logger=logger),
            )  # fmt: skip
            info = await engine.model_info()
            after = await engine.score(probe, len(prompts[0].prompt_ids))
            trained_version = backend.weight_version
            ckpt = find_latest_checkpoint(tmp_path / "out" / "checkpoints")
            state = json.loads((ckpt / "trainer_state.json").read_text())

            # an engine that fails to load during a step: the loop stops with the engine's
            # message, raised as itself, and the engine is left serving its old weights
            async with BadPathEngine(server.url, max_retries=0) as broken:
                with pytest.raises(WeightSyncError, match="Failed to get weights iterator"):
                    await run_rl_training(
                        backend, buffer, manager, [broken], RLLoopConfig(max_steps=1),
                        objective=RLObjective(grpo()), export_dir=tmp_path / "out" / "w2",
                    )  # fmt: skip
            assert (await engine.model_info()).weight_version == "3"
            assert (await engine.server_info())["internal_states"][0]["paused"] is False
    logger.close()
    assert info.weight_version == "3" and trained_version == 3
    assert max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs, strict=True)) > 1e-4
    assert len(history) == 3
    for m in history:
        assert m["time_sync_s"] > 0 and m["grad_norm"] > 0
        assert m["staleness_max"] == 0  # each batch generated after the last push finished
        assert "logprob_diff_max_abs" in m and m["logprob_diff_max_abs"] < 1e-3
    assert all(m["time_sync_engines_s"] > 0 for m in history[1:])
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert state["step"] == 3 and "data_buffer" in state["extra"]


async def test_cancelling_the_loop_leaves_no_process_and_a_loadable_checkpoint(
    tiny_model_dir, tmp_path
):
    files = write_arithmetic_datasets(tmp_path / "data", n_sft=10, n_rl=64, n_eval=8, seed=0)
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    buffer = DataBuffer(load_prompt_jsonl(files.rl_train, tok), seed=0)
    backend = PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=1e-3), max_steps=100,
        checkpoint_dir=tmp_path / "ck", pack_length=None,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip
    rollout = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                            sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    steps_done = []
    with backend:
        async with trio.open_nursery() as nursery:

            async def train() -> None:
                async with (
                    launch_engine(
                        kind="local",
                        model_path=tiny_model_dir,
                        extra_args=["--weight-version", "0", "--num-threads", "1"],
                        startup_timeout_s=120,
                    ) as launched,  # fmt: skip
                    SGLangEngine(launched.url) as engine,
                    AsyncRolloutManager(
                        engine,
                        buffer,
                        rollout,
                        reward_fn=digit_share_reward,
                        current_version=lambda: backend.weight_version,
                    ) as mgr,  # fmt: skip
                ):
                    steps_done.append(launched.pid)
                    await run_rl_training(
                        backend, buffer, mgr, [engine],
                        RLLoopConfig(max_steps=100, checkpoint_every=1),
                        objective=RLObjective(grpo()), export_dir=tmp_path / "w",
                        hooks=RLHooks(logger=lambda step, m: steps_done.append(step)),
                    )  # fmt: skip

            nursery.start_soon(train)
            with trio.fail_after(120):
                while len(steps_done) < 3:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    pid = steps_done[0]
    try:
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive
    latest = find_latest_checkpoint(tmp_path / "ck")
    assert latest is not None
    reloaded, _ = load_model_and_tokenizer(latest)
    assert sum(p.numel() for p in reloaded.parameters()) > 0
