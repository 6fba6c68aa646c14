"""Distributed weight pushes (`engines.weight_transport: distributed`) over launched local
engine processes: SGLang's refit protocol with gloo, end to end.

The engines are separate processes, as in use: torch names process groups per process, so a
trainer and an engine in one process cannot both join the same group.
"""

from __future__ import annotations

import os
import signal
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import torch
import trio
from lora_helpers import greedy
from rl_helpers import batch_of, prompts, rl_backend

from engines import EnginePool, SGLangEngine, launch_engine
from engines.refit import RefitGroup
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.manager import AsyncRolloutManager
from training.data.buffer import DataBuffer
from training.loops.rl import run_rl_training
from training.loops.weight_push import WeightsCopies, push_weights
from training.rl.algorithms import grpo
from training.rl.objective import RLObjective
from training.rl.step import train_on_batch
from training.rl_config import RLLoopConfig

PROMPT = [4, 5, 6, 7]


@asynccontextmanager
async def launched(n: int, model_dir: Path, logs: Path):
    """`n` local engine processes, started at once; yields their `LaunchedEngine`s."""
    up: dict[int, object] = {}
    ready = trio.Event()

    async def run(i: int) -> None:
        async with launch_engine(kind="local", model_path=model_dir,
                                 log_path=logs / f"e{i}.log") as engine:  # fmt: skip
            up[i] = engine
            if len(up) == n:
                ready.set()
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(run, i)
        await ready.wait()
        yield [up[i] for i in range(n)]
        nursery.cancel_scope.cancel()


async def assert_serves_trainer_weights(engine: SGLangEngine, backend, version: str) -> None:
    assert (await engine.model_info()).weight_version == version
    tokens, logprobs = greedy(backend.model.eval(), PROMPT, 6)
    result = await engine.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0})
    assert list(result.output_ids) == tokens
    assert max(abs(a - b) for a, b in zip(result.output_logprobs, logprobs, strict=True)) < 1e-5


@pytest.mark.slow
async def test_rl_by_broadcast_gives_engines_the_trainers_logprobs_and_writes_no_weights(
    tiny_model_dir, tmp_path
):
    async with launched(2, tiny_model_dir, tmp_path) as servers, AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(SGLangEngine(s.url, max_retries=0))
                   for s in servers]  # fmt: skip
        for n_engines in (1, 2):
            run_dir = tmp_path / f"run{n_engines}"
            backend = rl_backend(tiny_model_dir, run_dir)
            group = RefitGroup(timeout_s=30, bucket_mb=0.05)  # several buckets a push
            engines = clients[:n_engines]
            with backend:
                async with EnginePool(engines) as pool:
                    buffer = DataBuffer(prompts(backend.tokenizer), seed=0)
                    manager = AsyncRolloutManager(
                        pool, buffer,
                        RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                                      sampling=SamplingConfig(max_new_tokens=4)),
                        reward_fn=lambda s: float(s.index_in_group),
                        current_version=lambda b=backend: b.weight_version)  # fmt: skip
                    history = await run_rl_training(
                        backend, buffer, manager, engines,
                        RLLoopConfig(max_steps=2, checkpoint_every=10),
                        objective=RLObjective(grpo()), export_dir=run_dir / "weights",
                        refit=group)  # fmt: skip
                # versions as with disk: step k pushes version k, every engine reports it
                assert [m["weight_version"] for m in history] == [1, 2]
                for engine in engines:
                    await assert_serves_trainer_weights(engine, backend, "2")
                await group.close()
            assert not (run_dir / "weights").exists() or not any((run_dir / "weights").iterdir())


class KillingGroup(RefitGroup):
    """The real group; `kill` (a pid) is SIGKILLed just before the bucket `at` is sent."""

    kill: int | None = None
    at = 2
    sent = 0

    def send(self, tensors):
        self.sent += 1
        if self.kill is not None and self.sent == self.at:
            os.kill(self.kill, signal.SIGKILL)
            self.kill = None
        super().send(tensors)


@pytest.mark.slow
async def test_engine_killed_mid_broadcast_run_goes_on_and_it_rejoins_with_current_weights(
    tiny_model_dir, tmp_path
):
    backend = rl_backend(tiny_model_dir, tmp_path)
    group = KillingGroup(timeout_s=20, bucket_mb=0.05)

    async def step() -> str:  # one real optimizer step: the weights and their version move
        await train_on_batch(backend, batch_of([[0.0, 1.0]]), grpo(), temperature=1.0,
                             old_from_rollout=False, reference=None)  # fmt: skip
        return str(backend.weight_version)

    with backend:
        async with launched(1, tiny_model_dir, tmp_path) as (a,), AsyncExitStack() as stack:
            b_port = [0]
            b_up = trio.Event()
            relaunched = trio.Event()
            b_pid: list[int] = []

            async def run_b(nursery_ready) -> None:
                async with launch_engine(kind="local", model_path=tiny_model_dir,
                                         log_path=tmp_path / "b.log") as b:  # fmt: skip
                    b_port[0], b_pid[:] = b.port, [b.pid]
                    nursery_ready.set()
                    await b.exited.wait()
                # relaunched on the same port: the pool sees it answer again
                async with launch_engine(
                    kind="local",
                    model_path=tiny_model_dir,
                    port=b_port[0],
                    log_path=tmp_path / "b2.log",
                ):
                    relaunched.set()
                    await trio.sleep_forever()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_b, b_up)
                await b_up.wait()
                clients = [await stack.enter_async_context(SGLangEngine(url, max_retries=0))
                           for url in (a.url, f"http://127.0.0.1:{b_port[0]}")]  # fmt: skip
                async with EnginePool(clients, probe_interval_s=0.3) as pool:
                    version = await step()
                    await push_weights(backend, pool.engines, tmp_path / "weights", refit=group)
                    assert not (tmp_path / "weights").exists()  # by broadcast: no file
                    for engine in clients:
                        await assert_serves_trainer_weights(engine, backend, version)

                    version = await step()
                    group.kill, group.sent = b_pid[0], 0
                    with trio.fail_after(60):  # never hangs: the dead peer fails the broadcast
                        await push_weights(backend, pool.engines, tmp_path / "weights",
                                           refit=group)  # fmt: skip
                    await assert_serves_trainer_weights(clients[0], backend, version)
                    assert clients[1].expected_weights[1] == version  # given on rejoin, from disk

                    await relaunched.wait()
                    with trio.fail_after(60):
                        while not pool.statistics().engines[1].rejoined:
                            await trio.sleep(0.2)
                    await assert_serves_trainer_weights(clients[1], backend, version)

                    version = await step()  # the group is re-formed with the engine back in it
                    await push_weights(backend, pool.engines, tmp_path / "weights", refit=group)
                    assert group.members == tuple(c.url for c in clients)
                    for engine in clients:
                        await assert_serves_trainer_weights(engine, backend, version)
                await group.close()
                nursery.cancel_scope.cancel()


async def test_a_rejoin_copy_holds_and_names_the_weights_the_trainer_has_when_it_is_written(
    tiny_model_dir, tmp_path
):
    # asked for the last push's version after the trainer stepped again: the copy is labelled
    # and named with the newer version it holds (never old weights under a newer label)
    from safetensors.torch import load_file

    backend = rl_backend(tiny_model_dir, tmp_path)
    copies = WeightsCopies(backend, tmp_path / "weights")
    with backend:
        pushed = str(backend.weight_version)
        await train_on_batch(backend, batch_of([[0.0, 1.0]]), grpo(), temperature=1.0,
                             old_from_rollout=False, reference=None)  # fmt: skip
        path, version = await copies(pushed)
        assert version == str(backend.weight_version) != pushed
        assert Path(path) == tmp_path / "weights" / f"v{int(version):06d}"
        files: dict = {}
        for f in Path(path).glob("*.safetensors"):
            files |= load_file(str(f))
        state = backend.model.state_dict()
        assert files and all(torch.equal(t, state[k].to(t.dtype)) for k, t in files.items())
        assert await copies(version) == (path, version)  # written once per version
        assert [p.name for p in (tmp_path / "weights").iterdir()] == [Path(path).name]


@pytest.mark.slow
async def test_lone_engine_back_after_a_broadcast_push_gets_the_trainers_weights_with_no_push(
    tiny_model_dir, tmp_path
):
    # One engine, killed after a push by broadcast: no copy on disk, and with no engine no
    # batch, so no push, ever comes (issue 49 item D1). The pool's `weights_copy` writes one.
    backend = rl_backend(tiny_model_dir, tmp_path)
    group = RefitGroup(timeout_s=20, bucket_mb=0.05)
    weights = tmp_path / "weights"
    with backend:
        up, relaunched, where = trio.Event(), trio.Event(), {}

        async def run_engine() -> None:  # relaunched on the same port, as its supervisor does
            async with launch_engine(kind="local", model_path=tiny_model_dir,
                                     log_path=tmp_path / "e.log") as engine:  # fmt: skip
                where.update(port=engine.port, pid=engine.pid)
                up.set()
                await engine.exited.wait()
            async with launch_engine(kind="local", model_path=tiny_model_dir,
                                     port=where["port"], log_path=tmp_path / "e2.log"):  # fmt: skip
                relaunched.set()
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            nursery.start_soon(run_engine)
            await up.wait()
            client = await stack.enter_async_context(
                SGLangEngine(f"http://127.0.0.1:{where['port']}", max_retries=0))  # fmt: skip
            async with EnginePool([client], probe_interval_s=0.3,
                                  weights_copy=WeightsCopies(backend, weights)) as pool:  # fmt: skip
                await train_on_batch(backend, batch_of([[0.0, 1.0]]), grpo(), temperature=1.0,
                                     old_from_rollout=False, reference=None)  # fmt: skip
                version = str(backend.weight_version)
                await push_weights(backend, pool.engines, weights, refit=group)
                assert not weights.exists()  # by broadcast: no file
                await assert_serves_trainer_weights(client, backend, version)

                os.kill(where["pid"], signal.SIGKILL)
                await relaunched.wait()  # on its initial weights: the probe marks it down
                with trio.fail_after(60):
                    while not pool.statistics().engines[0].rejoined:
                        await trio.sleep(0.2)
                await assert_serves_trainer_weights(client, backend, version)
                assert client.expected_weights == (str(weights / f"v{int(version):06d}"), version)
            await group.close()
            nursery.cancel_scope.cancel()


@pytest.mark.slow
def test_torchrun_fsdp2_run_pushes_by_broadcast_bucket_by_bucket_and_writes_no_weights(
    tiny_model_dir, tmp_path
):
    # 2 ranks: each bucket is gathered whole (full_tensor) on both ranks and sent by rank 0;
    # the group's store is hosted by rank 0 itself, not torchelastic's agent store.
    import json

    from distributed_launch import launch

    out = tmp_path / "rl"
    proc = launch("examples/run_rl.py", "--config", "configs/rl_tiny.yaml", "--model",
                  str(tiny_model_dir), "--output-dir", str(out), "--max-steps", "2",
                  "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
                  "rollout.filter_groups=none", "train.eval_samples=4", "train.eval_every=1000",
                  "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
                  f"data.task_dir={tmp_path / 'data'}", "data.arithmetic.n_rl=64",
                  "data.arithmetic.n_eval=16", "engines.weight_transport=distributed",
                  "engines.weight_bucket_mb=1", world=2, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rows] == [1, 2]
    assert not (out / "weights").exists()
    log = (out / "engine_0.log").read_text()
    assert log.count("updated weights from a broadcast") == 2  # once a push, at its end
    assert log.count("of a broadcast on") >= 2 * 2  # several buckets a push (1 MiB, 12 MiB model)
