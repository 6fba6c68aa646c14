"""Issue 49 items D1, D3, D6: weight pushes and stall bounds under engine faults, at the shapes
the fault probe used. Real local engines (in-process over loopback HTTP; one launched process
for the broadcast), faults from `engines.testing.fault_proxy` or from killing an engine.

- D1: a push whose engines are all down (for the second or two before one rejoins) waits for
  one, bounded by `engines.unavailable_timeout_s`, in every transport; under distributed refit
  an engine left out of the group and down is no failure.
- D3: a hung `/update_weights_from_disk` costs its bound, not the client's 1,800 s, and its
  engine is marked down instead of being held paused.
- D6: a hung `/generate` is given up after its stall bound of outstanding time; a pause on the
  way no longer restarts the bound.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

import pytest
import trio
from lora_helpers import adapters_fixture, loaded_on  # noqa: F401  (fixture)
from lora_helpers import run_engine as run_lora_engine
from rl_helpers import batch_of, rl_backend
from test_engine_pool import run_engine, wait_for
from test_engine_stalls import STALL_2S, hung_and_good_engines

from engines import EnginePool, SGLangEngine, find_free_port, launch_engine
from engines.http import EngineTimeouts
from engines.refit import RefitGroup
from engines.sync_steps import update_bound_s, weights_gb
from engines.testing.fault_proxy import FaultPlan, FaultProxy
from engines.types import WeightSyncError
from engines.weight_sync import pause_engines, sync_lora_to_engines, sync_weights_to_engines
from plumbing.errors import EngineError
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import load_prompt_jsonl
from rollouts.tasks.arithmetic import digit_share_reward, write_arithmetic_datasets
from training.data.buffer import DataBuffer
from training.loops.rl import run_rl_training
from training.loops.weight_push import push_weights
from training.rl.algorithms import grpo
from training.rl.objective import RLObjective
from training.rl.step import train_on_batch
from training.rl_config import EnginesConfig, RLLoopConfig

SHORT = {"max_new_tokens": 4}


def client(url: str, **kw) -> SGLangEngine:
    return SGLangEngine(url, max_retries=0, **kw)


async def train_step(backend) -> str:
    """One real optimizer step: the weights and their version move."""
    await train_on_batch(backend, batch_of([[0.0, 1.0]]), grpo(), temperature=1.0,
                         old_from_rollout=False, reference=None)  # fmt: skip
    return str(backend.weight_version)


class Killable:
    """An in-process local engine on a fixed port that can be killed and started again."""

    def __init__(self, nursery: trio.Nursery, model_dir, run=run_engine) -> None:
        self.nursery, self.model_dir, self.run = nursery, model_dir, run
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.scope = trio.CancelScope()
        self.server = None

    async def start(self) -> None:
        self.scope = trio.CancelScope()
        self.server = await self.nursery.start(self._run)

    async def _run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            await self.run(self.model_dir, self.port, task_status=task_status)

    def kill(self) -> None:
        self.scope.cancel()


# ----- D1: every engine down for a moment ----------------------------------------------------


async def test_an_async_run_goes_on_when_its_only_engine_resets_a_generate_before_a_push(
    tiny_model_dir, tmp_path
):
    # The probe: one engine behind a proxy that resets its 4th /generate, rollout.mode=async:
    # the pool marks the engine down until its next probe (2 s), the push in that window
    # found every engine down and ended the run (exit 2 within seconds, 4 runs of 4).
    steps = 6
    files = write_arithmetic_datasets(tmp_path / "data", n_sft=10, n_rl=64, n_eval=4, seed=0)
    backend = rl_backend(tiny_model_dir, tmp_path)
    buffer = DataBuffer(load_prompt_jsonl(files.rl_train, backend.tokenizer), seed=0)
    rollout = RolloutConfig(batch_size=4, n_samples_per_prompt=2, filter_groups="none",
                            mode="async", sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    with backend:
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(run_engine, tiny_model_dir, find_free_port())
            proxy = FaultProxy(engine.url, FaultPlan(script=("pass",) * 3 + ("reset",)))
            url = await nursery.start(proxy.serve)
            async with client(url, retry_generate=False) as c, EnginePool([c]) as pool:
                manager = AsyncRolloutManager(pool, buffer, rollout, reward_fn=digit_share_reward,
                                              current_version=lambda: backend.weight_version)  # fmt: skip
                async with manager:
                    with trio.fail_after(120):
                        history = await run_rl_training(
                            backend, buffer, manager, [c],
                            RLLoopConfig(max_steps=steps, checkpoint_every=100),
                            objective=RLObjective(grpo()), export_dir=tmp_path / "w",
                            unavailable_timeout_s=EnginesConfig().unavailable_timeout_s,
                        )  # fmt: skip
                stats = pool.statistics().engines[0]
                served = (await c.model_info()).weight_version
            nursery.cancel_scope.cancel()
    print(f"steps {len(history)}; proxy {dict(proxy.counts)}; engine {stats}")
    assert proxy.counts["reset"] == 1 and stats.failures.get("unreachable") == 1
    assert [m["weight_version"] for m in history] == list(range(1, steps + 1))
    assert served == str(steps)


@pytest.mark.parametrize("transport", ["disk", "distributed"])
async def test_a_push_with_every_engine_down_waits_for_one_to_come_back(
    tiny_model_dir, tmp_path, transport, caplog
):
    # Two engines, both down when the push starts; one is back a second later. A distributed
    # push with no engine to form a group with falls back to disk as a whole.
    backend = rl_backend(tiny_model_dir, tmp_path)
    refit = RefitGroup(timeout_s=10) if transport == "distributed" else None
    with backend:
        async with trio.open_nursery() as nursery:
            engines = [Killable(nursery, tiny_model_dir) for _ in range(2)]
            for e in engines:
                await e.start()
            async with (
                client(engines[0].url) as a,
                client(engines[1].url) as b,
                EnginePool([a, b], probe_interval_s=0.2) as pool,
            ):
                await train_step(backend)
                await push_weights(backend, [a, b], tmp_path / "w")  # what a probe checks
                for e in engines:
                    e.kill()
                await wait_for(lambda: not any(s.healthy for s in pool.statistics().engines))
                version = await train_step(backend)
                took = [0.0]

                async def push() -> None:
                    t0 = trio.current_time()
                    await push_weights(backend, [a, b], tmp_path / "w", refit=refit,
                                       unavailable_timeout_s=30)  # fmt: skip
                    took[0] = trio.current_time() - t0

                with caplog.at_level(logging.WARNING), trio.fail_after(60):
                    async with trio.open_nursery() as pushing:
                        pushing.start_soon(push)
                        await trio.sleep(1.0)
                        await engines[0].start()  # back on its initial weights
                assert (await a.model_info()).weight_version == version
                await wait_for(lambda: pool.statistics().engines[0].healthy)
                result = await pool.generate([3, 4], SHORT)
                assert result.weight_version == version
                assert b.expected_weights[1] == version  # given them when it is back
                assert took[0] >= 1.0 and "every engine is down" in caplog.text

                # none back within the bound: the push fails, naming the bound to raise
                engines[0].kill()
                await wait_for(lambda: not pool.statistics().engines[0].healthy)
                await train_step(backend)
                with pytest.raises(WeightSyncError, match=r"engines\.unavailable_timeout_s"):
                    await push_weights(backend, [a, b], tmp_path / "w", refit=refit,
                                       unavailable_timeout_s=1.5)  # fmt: skip
            nursery.cancel_scope.cancel()


async def test_a_lora_sync_with_its_only_engine_down_waits_for_it_to_come_back(
    tiny_model_dir, adapters
):
    async with trio.open_nursery() as nursery:
        engine = Killable(nursery, tiny_model_dir, run=run_lora_engine)
        await engine.start()
        async with client(engine.url) as a, EnginePool([a], probe_interval_s=0.2) as pool:
            await sync_lora_to_engines([a], adapters["a1"], "policy-v1", "v1")
            engine.kill()
            await wait_for(lambda: not pool.statistics().engines[0].healthy)

            async def back_in_a_second() -> None:
                await trio.sleep(1.0)
                await engine.start()  # back without adapters

            with trio.fail_after(60):
                async with trio.open_nursery() as syncing:
                    syncing.start_soon(back_in_a_second)
                    await sync_lora_to_engines([a], adapters["a2"], "policy-v2", "v2", wait_s=30)
            assert await loaded_on(a.url) == {"policy-v2": str(adapters["a2"])}
            assert (await a.model_info()).weight_version == "v2"
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_broadcast_push_goes_on_when_the_engine_left_out_of_its_group_is_down(
    tiny_model_dir, tmp_path
):
    # The probe: engines.n_local=2, weight_transport=distributed, one engine killed: the next
    # push broadcast to the live one, then failed with "1 of 1 engine(s)" down for the disk
    # copy of the one left out, and the run ended (4 runs of 4).
    backend = rl_backend(tiny_model_dir, tmp_path)
    group = RefitGroup(timeout_s=20, bucket_mb=0.05)
    with backend:
        async with (
            launch_engine(kind="local", model_path=tiny_model_dir,
                          log_path=tmp_path / "a.log") as launched,
            trio.open_nursery() as nursery,
            AsyncExitStack() as stack,
        ):  # fmt: skip
            b_engine = Killable(nursery, tiny_model_dir)  # in-process: it never joins a group
            await b_engine.start()
            a = await stack.enter_async_context(client(launched.url))
            b = await stack.enter_async_context(client(b_engine.url))
            async with EnginePool([a, b], probe_interval_s=0.2) as pool:
                await train_step(backend)
                await push_weights(backend, [a, b], tmp_path / "w")  # from disk: what probes check
                b_engine.kill()
                await wait_for(lambda: not pool.statistics().engines[1].healthy)
                version = await train_step(backend)
                with trio.fail_after(60):
                    await push_weights(backend, [a, b], tmp_path / "w", refit=group)
                assert group.members == (a.url,)  # by broadcast to the live engine
                assert (await a.model_info()).weight_version == version
                copy = str(tmp_path / "w" / f"v{int(version):06d}")
                assert b.expected_weights == (copy, version)  # a disk copy for the one left out
                await b_engine.start()  # back: the pool gives it that copy before it serves
                await wait_for(lambda: pool.statistics().engines[1].rejoined == 1)
                assert (await b.model_info()).weight_version == version
            await group.close()
            nursery.cancel_scope.cancel()


async def test_a_rejoin_never_overwrites_the_weights_a_push_recorded_while_it_ran(
    tiny_model_dir, tmp_path
):
    # The fault matrix's sync-disk-e2-a (stale 8): an engine marked down after a reset was
    # given weights 2 by the pool's rejoin while the push of weights 3 skipped it as down and
    # recorded 3 for it; the rejoin's own sync then wrote 2 over that record, so the rejoin saw
    # no newer push, let the engine serve 2, and step 4 trained 2 groups of version-2 samples.
    backend = rl_backend(tiny_model_dir, tmp_path)
    with backend:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(run_engine, tiny_model_dir, find_free_port())
            async with client(server.url) as a:
                await train_step(backend)
                older = await backend.export_weights(tmp_path / "w" / "v2")
                version = await train_step(backend)
                newer = str(await backend.export_weights(tmp_path / "w" / "v3"))
                a.expected_weights = (newer, version)  # what the push recorded meanwhile
                await sync_weights_to_engines([a], older, "2", rejoin=True)
                assert a.expected_weights == (newer, version)  # the rejoin gives it next
            nursery.cancel_scope.cancel()


# ----- D3: a weight load that hangs -----------------------------------------------------------


async def test_a_hung_weight_load_is_given_up_within_its_bound_and_its_engine_marked_down(
    tiny_model_dir, tmp_path, caplog
):
    # The probe: a hung /update_weights_from_disk on one of two engines stalled the run with no
    # log line; the trainer renewed its pause lease, the only limit was the client's 1,800 s.
    backend = rl_backend(tiny_model_dir, tmp_path)
    bound = EngineTimeouts(weight_update_floor_s=2.0, weight_update_s_per_gb=0.0)
    loads = ("/update_weights_from_disk",)
    with backend:
        async with trio.open_nursery() as nursery:
            good, hung = [await nursery.start(run_engine, tiny_model_dir, find_free_port())
                          for _ in range(2)]  # fmt: skip
            proxy = FaultProxy(hung.url, FaultPlan(rates={"hang": 1.0}, hang_s=600.0,
                                                   paths=loads))  # fmt: skip
            proxy_url = await nursery.start(proxy.serve)
            async with (
                client(good.url, timeouts=bound) as a,
                client(proxy_url, timeouts=bound) as b,
                EnginePool([a, b], probe_interval_s=0.2) as pool,
            ):
                version = await train_step(backend)
                t0 = trio.current_time()
                with caplog.at_level(logging.WARNING), trio.fail_after(30):
                    await push_weights(backend, [a, b], tmp_path / "w")
                took = trio.current_time() - t0
                assert 2.0 <= took < 2.0 + 10.0  # its bound, not 1,800 s (10 s: a loaded CI)
                assert (await a.model_info()).weight_version == version
                warned = [r.getMessage() for r in caplog.records
                          if proxy_url in r.getMessage() and "2.0 s" in r.getMessage()]  # fmt: skip
                assert len(warned) == 1 and "engines.weight_update_floor_s" in warned[0]
                # marked down (at the pool's next probe), and the next push does not pay the
                # bound again while it still hangs
                await wait_for(lambda: not pool.statistics().engines[1].healthy, timeout=5.0)
                version = await train_step(backend)
                t0 = trio.current_time()
                with trio.fail_after(30):
                    await push_weights(backend, [a, b], tmp_path / "w")
                again = trio.current_time() - t0
                print(f"pushes with one hung load (bound 2.0 s): {took:.2f} s, then {again:.2f} s")
                assert again < 2.0 and not pool.statistics().engines[1].healthy
                assert b.expected_weights[1] == version  # given them when it is back
                # once its loads answer it is given the weights before it serves: it never
                # serves its old weights meanwhile
                proxy.plan = FaultPlan(paths=loads)
                await wait_for(lambda: pool.statistics().engines[1].rejoined == 1)
                assert (await b.model_info()).weight_version == version
                results = [await pool.generate([3, 4], SHORT) for _ in range(4)]
                assert {r.weight_version for r in results} == {version}
            nursery.cancel_scope.cancel()


def test_the_weight_load_bound_is_well_under_a_minute_for_small_models_and_grows_with_size(
    tmp_path,
):
    ec = EnginesConfig()
    timeouts = EngineTimeouts(weight_update_floor_s=ec.weight_update_floor_s,
                              weight_update_s_per_gb=ec.weight_update_s_per_gb)  # fmt: skip
    engine = SGLangEngine("http://127.0.0.1:1", timeouts=timeouts)
    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir(), big.mkdir()
    (small / "model.safetensors").write_bytes(b"\0" * 1_000_000)
    for i in range(2):  # 2 × 8 GB, sparse: nothing is written
        with open(big / f"model-{i}.safetensors", "wb") as f:
            f.truncate(8 * 10**9)
    assert weights_gb(small) == pytest.approx(0.001) and weights_gb(big) == pytest.approx(16.0)
    assert update_bound_s(engine, weights_gb(small)) < 40.0
    assert update_bound_s(engine, weights_gb(big)) >= 16 * 5.0  # ≥ 5 s a GB: a slow disk loads


async def test_a_hung_broadcast_costs_its_broadcast_deadline_not_the_group_or_http_deadline(
    tiny_model_dir, tmp_path, caplog
):
    # The fault matrix's *-distributed-*-d cells: an engine's proxy holds one
    # /update_weights_from_distributed; the trainer's broadcast waited out the group's gloo
    # timeout (engines.weight_group_timeout_s, 120 s) and the push then waited for that receive
    # call's own HTTP deadline (150 s): every run stalled past its 150 s budget. A hung update
    # now costs the broadcast deadline (here 2 s) plus the 10 s after which a receive still
    # pending is given up on; the push goes on through disk.
    backend = rl_backend(tiny_model_dir, tmp_path)
    group = RefitGroup(timeout_s=60, broadcast_timeout_s=2.0, bucket_mb=0.05)  # several buckets
    with backend:
        async with (
            launch_engine(kind="local", model_path=tiny_model_dir,
                          log_path=tmp_path / "a.log") as launched,
            trio.open_nursery() as nursery,
        ):  # fmt: skip
            proxy = FaultProxy(launched.url, FaultPlan(
                script=("pass", "hang"), paths=("/update_weights_from_distributed",),
                hang_s=600.0))  # fmt: skip
            url = await nursery.start(proxy.serve)
            async with client(url) as a, EnginePool([a], probe_interval_s=0.2):
                version = await train_step(backend)
                t0 = trio.current_time()
                with caplog.at_level(logging.WARNING), trio.fail_after(50):  # before: >= 60 s
                    await push_weights(backend, [a], tmp_path / "w", refit=group)
                took = trio.current_time() - t0
                print(f"a push with a hung bucket (broadcast deadline 2 s): {took:.1f} s")
                assert proxy.counts["hang"] == 1 and "by broadcast failed" in caplog.text
                assert "given up on" in caplog.text  # the hung receive, named
                assert (await a.model_info()).weight_version == version  # from disk
                version = await train_step(backend)  # the group is formed again: by broadcast
                await push_weights(backend, [a], tmp_path / "w", refit=group)
                assert group.members == (url,) and (await a.model_info()).weight_version == version
                await group.close()
            nursery.cancel_scope.cancel()


async def test_a_broadcast_push_holds_its_pauses_while_a_failed_broadcast_waits_its_deadline(
    tiny_model_dir, tmp_path
):
    # An engine's /update_weights_from_distributed answers 500 at once: its receive ends, and
    # with it the renewal of its pause lease, while the trainer's broadcast waits out its
    # deadline. With a lease shorter than that wait the engine resumed by itself mid-push and
    # served its old weights; the push's whole update now renews the leases it holds.
    backend = rl_backend(tiny_model_dir, tmp_path)
    group = RefitGroup(timeout_s=60, broadcast_timeout_s=6.0)
    log = tmp_path / "a.log"
    with backend:
        async with (
            launch_engine(kind="local", model_path=tiny_model_dir, log_path=log) as launched,
            trio.open_nursery() as nursery,
        ):  # fmt: skip
            proxy = FaultProxy(launched.url, FaultPlan(
                script=("500",), paths=("/update_weights_from_distributed",)))  # fmt: skip
            url = await nursery.start(proxy.serve)
            async with client(url, pause_lease_s=1.5) as a:
                version = await train_step(backend)
                with trio.fail_after(50):
                    await push_weights(backend, [a], tmp_path / "w", refit=group)
                assert proxy.counts["500"] == 1
                assert (await a.model_info()).weight_version == version  # from disk
                await group.close()
            nursery.cancel_scope.cancel()
    assert "pause lease" not in log.read_text()  # it never resumed by itself mid-push


async def test_an_engine_that_dies_while_paused_for_a_push_rejoins_within_the_pushs_wait(
    tiny_model_dir, tmp_path
):
    # The fault matrix's overlap-distributed-e1-c: the only engine was killed while a push held
    # it paused; a request marked it down, the push skipped it as known down without resuming
    # it, so its client still held it "paused", the pool's probe left it alone, and the push
    # waited out engines.unavailable_timeout_s (60 s) for an engine back after seconds: exit 2.
    backend = rl_backend(tiny_model_dir, tmp_path)
    with backend:
        async with trio.open_nursery() as nursery:
            engine = Killable(nursery, tiny_model_dir)
            await engine.start()
            async with (
                client(engine.url) as a,
                EnginePool([a], probe_interval_s=0.2, unavailable_timeout_s=1.0) as pool,
            ):  # fmt: skip
                await train_step(backend)
                await push_weights(backend, [a], tmp_path / "w")
                version = await train_step(backend)
                path = await backend.export_weights(tmp_path / "w" / "next")
                await pause_engines([a])  # a push holds it paused ...
                engine.kill()  # ... when it dies; a request finds it gone
                with trio.move_on_after(5.0), pytest.raises(EngineError):
                    await pool.generate([3, 4], SHORT)
                assert not pool.statistics().engines[0].healthy

                async def back_in_a_second() -> None:
                    await trio.sleep(1.0)
                    await engine.start()  # back on its initial weights

                with trio.fail_after(40):  # before: the push waited its 30 s and failed
                    async with trio.open_nursery() as pushing:
                        pushing.start_soon(back_in_a_second)
                        await sync_weights_to_engines([a], path, version, paused=True, wait_s=30)
                assert (await a.model_info()).weight_version == version
                assert pool.statistics().engines[0].healthy and not a.paused
            nursery.cancel_scope.cancel()


# ----- D6: a stall bound that pauses restarted ------------------------------------------------


async def test_a_hung_generate_is_given_up_after_its_bound_of_outstanding_time_across_a_sync(
    tiny_model_dir,
):
    # The probe: a hung request waited 123 s, twice its 61.6 s bound, because the weight sync
    # paused its engine on the way and every pause started the bound again.
    async with trio.open_nursery() as nursery:
        proxy, proxy_url, good_url = await hung_and_good_engines(nursery, tiny_model_dir)
        async with (
            client(proxy_url) as a,
            client(good_url) as b,
            EnginePool([a, b], **STALL_2S) as pool,
        ):  # fmt: skip
            paused_s = [0.0]

            async def sync_meanwhile() -> None:  # a push pauses the hung engine and resumes it
                await trio.sleep(0.5)
                t0 = trio.current_time()
                await pause_engines([a])
                await sync_weights_to_engines([a], tiny_model_dir, "0", paused=True)
                paused_s[0] = trio.current_time() - t0

            nursery.start_soon(sync_meanwhile)
            t0 = trio.current_time()
            with trio.fail_after(30):
                result = await pool.generate([1, 2, 3], SHORT, rid="stall-r0.")
            took = trio.current_time() - t0
            stats = pool.statistics().engines
        print(f"stall bound 2.0 s, paused {paused_s[0]:.2f} s on the way: answered in {took:.2f} s")
        assert proxy.counts["hang"] == 1 and stats[0].failures == {"stalled": 1}
        assert result.completion_tokens == 4 and stats[1].done == 1
        # the bound of outstanding time, plus the pause, plus two ticks (2 / 16 s each) and a
        # margin for a loaded machine; restarting the bound at the pause took 4 s or more
        assert 2.0 <= took < 2.0 + paused_s[0] + 0.25 + 0.75
        nursery.cancel_scope.cancel()
