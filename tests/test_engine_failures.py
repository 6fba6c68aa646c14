"""Engines that fail (issue 12 items 12, 13, 14, 17): failover of 5xx and timeouts, a dead engine
skipped by the weight sync and given the current weights when it returns, groups dropped and
counted up to a failure rate, relaunch, and engines that die with their parent. Real local
engines; failures come from `engines.testing.fault_proxy` or from killing the engine."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import trio
from test_engine_launch import alive, pids_with_port
from test_engine_pool import run_engine, wait_for

from engines import EnginePool, SGLangEngine, find_free_port, sync_weights_to_engines
from engines.http import EngineTimeouts
from engines.pool import NoEngineAvailableError
from engines.supervisor import supervise_engine
from engines.testing.fault_proxy import FaultPlan, FaultProxy
from engines.weight_sync import pause_engines
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.errors import RolloutsError
from rollouts.manager import AsyncRolloutManager
from training.data.buffer import DataBuffer
from training.loops.weight_push import leave_engines_on_final_weights
from training.recipes.rl_summary import EngineWatch, RLSummary

SHORT = {"max_new_tokens": 4}


def client(url: str, **kw) -> SGLangEngine:
    return SGLangEngine(url, max_retries=0, **kw)


async def test_5xx_and_timeouts_fail_over_to_another_engine_and_are_counted(tiny_model_dir):
    async with trio.open_nursery() as nursery:
        good, flaky = [await nursery.start(run_engine, tiny_model_dir, find_free_port())
                       for _ in range(2)]  # fmt: skip
        plan = FaultPlan(rates={"500": 0.5, "hang": 0.5}, hang_s=5.0)
        proxy = FaultProxy(flaky.url, plan)
        proxy_url = await nursery.start(proxy.serve)
        fast = EngineTimeouts(generate_s=1.0)
        async with client(proxy_url, timeouts=fast) as a, client(good.url) as b:
            async with EnginePool([a, b], probe_interval_s=60) as pool:
                with trio.fail_after(30):
                    results = [await pool.generate([i + 1, 2], SHORT, rid=f"r{i}.")
                               for i in range(8)]  # fmt: skip
                stats = pool.statistics().engines
            assert len(results) == 8 and all(r.completion_tokens == 4 for r in results)
            assert stats[1].done == 8 and stats[0].done == 0
            assert stats[0].failures == {"HTTP 500": proxy.counts["500"],
                                         "timeout": proxy.counts["hang"]}  # fmt: skip
            assert proxy.counts["500"] > 0 and proxy.counts["hang"] > 0
            alone = EnginePool([a], probe_interval_s=60, unavailable_timeout_s=1.0)
            async with alone:  # nowhere else to go: retried until the bound, then named
                proxy.plan = FaultPlan(rates={"500": 1.0})
                t0 = trio.current_time()
                with pytest.raises(NoEngineAvailableError, match=r"in 1\.\d s .*HTTP 500"):
                    await alone.generate([1, 2], SHORT)
                assert 1.0 <= trio.current_time() - t0 < 3.0
        nursery.cancel_scope.cancel()


async def test_a_pool_of_one_waits_out_a_reset_a_500_a_truncated_body_and_a_hang(tiny_model_dir):
    # Issue 26 item 1: the only engine failing once used to end the request at once.
    async with trio.open_nursery() as nursery:
        engine = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        script = ("reset", "pass", "500", "pass", "truncate", "pass", "hang")
        proxy = FaultProxy(engine.url, FaultPlan(script=script, hang_s=30.0))
        url = await nursery.start(proxy.serve)
        fast = EngineTimeouts(generate_s=1.0)  # the hang ends at the request's deadline
        async with client(url, timeouts=fast) as a, EnginePool([a], probe_interval_s=0.1) as pool:
            with trio.fail_after(30):
                results = [await pool.generate_batch([[i + 1, 2]] * 2, SHORT,
                                                     rids=[f"r{i}.0", f"r{i}.1"])
                           for i in range(4)]  # fmt: skip
            stats = pool.statistics().engines[0]
        nursery.cancel_scope.cancel()
    assert [len(r) for r in results] == [2, 2, 2, 2]
    assert all(x.completion_tokens == 4 for r in results for x in r)
    faults = {k: n for k, n in proxy.counts.items() if k != "forwarded"}  # probes are forwarded
    assert faults == {"reset": 1, "500": 1, "truncate": 1, "hang": 1}
    assert stats.failures == {"unreachable": 2, "HTTP 500": 1, "timeout": 1}
    assert (stats.done, stats.samples_sent, stats.samples_received) == (4, 16, 8)


async def start_doomed_engine(nursery: trio.Nursery, model_dir, port: int
                              ) -> tuple[trio.CancelScope, object]:  # fmt: skip
    """A local engine on `port` that dies when the returned scope is cancelled: (that scope,
    what `run_engine` started)."""
    doomed = trio.CancelScope()

    async def run_doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with doomed:
            await run_engine(model_dir, port, task_status=task_status)

    return doomed, await nursery.start(run_doomed)


async def test_dead_engine_is_skipped_by_the_sync_and_given_the_weights_before_it_serves(
    tiny_model_dir, tiny_model_dir_seed1
):
    port = find_free_port()
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        doomed, _ = await start_doomed_engine(nursery, tiny_model_dir, port)
        async with (
            client(live.url) as a,
            client(f"http://127.0.0.1:{port}") as b,
            EnginePool([a, b], probe_interval_s=0.2) as pool,
        ):
            doomed.cancel()  # engine b dies
            await sync_weights_to_engines([a, b], tiny_model_dir_seed1, "1")  # goes on
            assert (await a.model_info()).weight_version == "1"
            await wait_for(lambda: not pool.statistics().engines[1].healthy)
            # b comes back on its initial weights: it is given "1" before it serves
            restarted = await nursery.start(run_engine, tiny_model_dir, port)
            await wait_for(lambda: pool.statistics().engines[1].healthy)
            assert restarted.state.weight_version == "1"
            assert pool.statistics().engines[1].rejoined == 1
            results = [await pool.generate([3, 4], SHORT) for _ in range(4)]
            assert {r.weight_version for r in results} == {"1"}
            assert pool.statistics().engines[1].done >= 1
        nursery.cancel_scope.cancel()


async def test_a_dead_engine_warns_once_going_down_and_once_coming_back_whatever_the_steps(
    tiny_model_dir, tiny_model_dir_seed1, caplog
):
    # Issue 42: a dead engine logged 2 WARNINGs per step (the pause and the push skipping it).
    caplog.set_level(logging.DEBUG, logger="engines")
    port, steps = find_free_port(), 8
    url = f"http://127.0.0.1:{port}"
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        doomed, _ = await start_doomed_engine(nursery, tiny_model_dir, port)
        async with client(live.url) as a, client(url) as b, \
                EnginePool([a, b], probe_interval_s=0.2) as pool:  # fmt: skip

            async def step(version: int) -> None:  # what an RL step does with the engines
                await pool.generate([3, version], SHORT)
                await pause_engines([a, b])
                model = tiny_model_dir_seed1 if version % 2 else tiny_model_dir
                await sync_weights_to_engines([a, b], model, str(version), paused=True)

            watch = EngineWatch(pool)  # what the recipe's summary reports
            await step(0)
            watch(1, {})
            doomed.cancel()  # engine b dies during step 2; the probe finds it serves no weights
            await wait_for(lambda: not pool.statistics().engines[1].healthy)
            for version in range(1, steps + 1):
                await step(version)
                watch(version + 1, {})
            down = pool.statistics().engines[1].down_reason
            summary = RLSummary(0.5, 0.5, steps + 1, 1.0, None, (), engines_total=watch.total,
                                engines_lost=watch.lost()).line()  # fmt: skip
            await nursery.start(run_engine, tiny_model_dir, port)  # b is back
            await wait_for(lambda: pool.statistics().engines[1].healthy)
            await step(steps + 1)
            watch(steps + 2, {})
            assert pool.statistics().engines[1].down_reason is None and watch.lost() == ()
        nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and r.name.startswith("engines")]  # fmt: skip
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"engine {url} marked down (1 of 2 engines serve;")
    assert warnings[1] == f"engine {url} is back and serves weights {steps} (2 of 2 engines serve)"
    skipped = [r for r in caplog.records if "down" in r.getMessage() and r.levelno == logging.DEBUG]
    assert len(skipped) == 2 * steps  # each step's pause and push still say so, at DEBUG
    assert down is not None and down.startswith("EngineUnavailableError: probe failed")
    assert summary.endswith(f"; finished on 1 of 2 engines; lost {url}: {down} at step 2"), summary


async def test_an_engine_whose_resume_failed_after_a_rejoins_sync_is_resumed_and_serves_again(
    tiny_model_dir, tiny_model_dir_seed1
):
    """A down engine's rejoin paused it, gave it the weights, and its `/continue_generation`
    failed (a 500; a timeout alike): the engine may still be paused (SGLang's pause has no
    lease), and a pool does not probe an engine its client has paused. Each probe sends the
    resume again until it gets through; then the engine rejoins and serves (it stayed paused
    and out of the pool for the rest of the run)."""
    async with trio.open_nursery() as nursery:
        server = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        proxy = FaultProxy(server.url, FaultPlan(paths=()))
        url = await nursery.start(proxy.serve)
        async with client(url) as engine, EnginePool([engine], probe_interval_s=0.2) as pool:
            await sync_weights_to_engines([engine], tiny_model_dir_seed1, "1")
            proxy.replan(FaultPlan(paths=("/model_info",), rates={"500": 1.0}))
            await wait_for(lambda: not pool.statistics().engines[0].healthy, 10)  # a probe
            failed = proxy.counts["500"]
            proxy.replan(FaultPlan(paths=("/continue_generation",), script=("500",)))
            await wait_for(lambda: proxy.counts["500"] == failed + 1, 10)  # a rejoin's resume
            await wait_for(lambda: pool.statistics().engines[0].healthy, 10)
            assert not server.state.scheduler.paused and not engine.paused
            result = await pool.generate([3, 4], SHORT)
            assert result.weight_version == "1"
            assert proxy.counts["500"] == failed + 1
        nursery.cancel_scope.cancel()


async def test_an_engine_restarted_between_probes_never_has_its_old_weights_used(
    tiny_model_dir, tiny_model_dir_seed1
):
    port = find_free_port()
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        first = trio.CancelScope()

        async def run_first(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with first:
                await run_engine(tiny_model_dir, port, task_status=task_status)

        await nursery.start(run_first)
        async with (
            client(live.url) as a,
            client(f"http://127.0.0.1:{port}") as b,
            EnginePool([a, b], probe_interval_s=3600) as pool,  # no probe sees the restart
        ):
            await sync_weights_to_engines([a, b], tiny_model_dir_seed1, "1")
            first.cancel()
            await nursery.start(run_engine, tiny_model_dir, port)  # back on version "0"
            results = [await pool.generate([3, 4], SHORT) for _ in range(4)]
            stats = pool.statistics().engines
        assert {r.weight_version for r in results} == {"1"}
        assert stats[1].failures == {"stale weights": 1} and not stats[1].healthy
        nursery.cancel_scope.cancel()


async def test_failed_groups_are_dropped_and_counted_until_the_rate_ends_the_run(
    tiny_model_dir, tiny_tokenizer
):
    from test_rollout_manager import make_prompts

    async with trio.open_nursery() as nursery:
        engine = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        proxy = FaultProxy(engine.url, FaultPlan(rates={"500": 1.0}))
        proxy_url = await nursery.start(proxy.serve)
        cfg = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                            sampling=SamplingConfig(max_new_tokens=4), max_failed_group_rate=0.5)  # fmt: skip
        pool = EnginePool([flaky := client(proxy_url)], unavailable_timeout_s=1.0)
        async with flaky, pool:  # every answer a 500: retried for 1 s, then the group fails
            manager = AsyncRolloutManager(pool, DataBuffer(make_prompts(tiny_tokenizer, 16)),
                                          cfg, reward_fn=lambda s: 0.0)  # fmt: skip
            with pytest.raises(RolloutsError) as ended:
                await manager.generate_batch()
            assert f"{proxy_url}: gave up after HTTP 500 x" in str(ended.value)
            proxy.enabled = False  # under the rate: the run goes on, failures counted
            batch = await manager.generate_batch()
            assert len(batch.groups) == 2 and batch.metrics["groups_failed"] == 0
        nursery.cancel_scope.cancel()


async def test_a_supervised_engine_killed_with_sigkill_is_relaunched_on_its_port(
    tiny_model_dir, tmp_path
):
    async with supervise_engine(kind="local", model_path=tiny_model_dir, relaunch_delay_s=0.1,
                                log_path=tmp_path / "e.log", max_relaunches=1) as supervised:  # fmt: skip
        first = supervised.current.pid
        os.kill(first, signal.SIGKILL)
        await wait_for(lambda: supervised.relaunches == 1 and supervised.current.pid != first, 60)
        async with client(supervised.url) as engine:
            await engine.wait_healthy(60, poll_interval_s=0.2)
            assert (await engine.generate([1, 2], SHORT)).completion_tokens == 4
    assert supervised.pids == [first, supervised.current.pid] and not alive(supervised.pids[1])


# A server that knows nothing of us (as SGLang): answers 200 to everything on --port.
STAND_IN_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Ok).serve_forever()
"""


@pytest.mark.parametrize("kind", ["local", "sglang"])
def test_launched_engines_die_with_their_parent(kind, tiny_model_dir, tmp_path):
    command = None if kind == "local" else [sys.executable, "-c", STAND_IN_SERVER]
    script = textwrap.dedent(f"""
        import sys, trio
        sys.path.insert(0, {os.getcwd()!r})
        from engines import launch_engine
        async def main():
            async with launch_engine({command!r}, kind={kind!r},
                                     model_path={str(tiny_model_dir)!r},
                                     log_path={str(tmp_path / "e.log")!r}) as e:
                print(e.port, flush=True)
                await trio.sleep(600)
        trio.run(main)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        port = int(parent.stdout.readline())  # type: ignore[union-attr]
        pids = pids_with_port(port)  # the server (and the guard around an SGLang kind)
        assert len(pids) == (1 if kind == "local" else 2) and all(alive(p) for p in pids)
        parent.kill()  # SIGKILL: no cleanup runs in the parent
        parent.wait(10)
        deadline = time.monotonic() + 10  # the watchdogs poll every 0.5 s
        while any(alive(p) and not _zombie(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        parent.kill()
    assert all(not alive(p) or _zombie(p) for p in pids), "an engine outlived its parent"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def test_sync_mode_with_sync_every_above_one_is_refused():
    from training.rl_config import RLRunConfig

    with pytest.raises(ValueError, match="train stale samples as on-policy"):
        RLRunConfig.model_validate({"rollout": {"mode": "sync"}, "train": {"sync_every": 2}})
    RLRunConfig.model_validate({"rollout": {"mode": "overlap"}, "train": {"sync_every": 2}})


async def test_the_pool_hears_a_relaunch_before_sending_work(tiny_model_dir, tmp_path):
    # probes far apart: only the supervisor's word can mark the engine down and up in time
    send, recv = trio.open_memory_channel[tuple[str, str]](100)
    async with (
        supervise_engine(kind="local", model_path=tiny_model_dir, relaunch_delay_s=1.0,
                         log_path=tmp_path / "e.log", max_relaunches=1, events=send) as supervised,
        client(supervised.url) as engine,
        EnginePool([engine], probe_interval_s=60, engine_events=recv) as pool,
    ):  # fmt: skip
        os.kill(supervised.current.pid, signal.SIGKILL)
        await wait_for(lambda: not pool.statistics().engines[0].healthy, 5)  # before relaunch
        assert supervised.relaunches == 1 and pool.statistics().engines[0].samples_sent == 0
        with trio.fail_after(60):  # sent now, it waits for the relaunch instead of failing
            result = await pool.generate([1, 2], SHORT)
        stats = pool.statistics().engines[0]
        assert result.completion_tokens == 4 and stats.rejoined == 1
        assert stats.failed == 0 and stats.samples_sent == 1  # nothing went to the dead engine


async def test_the_run_end_gives_the_final_weights_to_each_engine_that_answers_and_names_the_rest(
    tiny_model_dir, tiny_model_dir_seed1
):
    """Issue 49: an engine marked down near a run's end (a transient fault, a relaunch) that
    answers again is given the final weights before the run ends, bounded: from the last push's
    copy on disk, or from a copy written for it when that push went by broadcast. An engine that
    never answers is named after the bound."""
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        doomed, other = await start_doomed_engine(nursery, tiny_model_dir, find_free_port())
        send, events = trio.open_memory_channel[tuple[str, str]](8)
        exports: list[int] = []

        async def export() -> str:  # the final weights' HF export, as the backend writes it
            exports.append(1)
            return str(tiny_model_dir)

        async def versions() -> list[str]:
            return [(await e.model_info()).weight_version for e in (a, b)]

        async with client(live.url) as a, client(other.url) as b, \
                EnginePool([a, b], probe_interval_s=60, engine_events=events) as pool:  # fmt: skip
            await sync_weights_to_engines([a, b], tiny_model_dir, "1")
            await send.send(("down", b.url))  # b answers, but the pool lost it for a while
            await wait_for(lambda: not pool.statistics().engines[1].healthy)
            await sync_weights_to_engines([a, b], tiny_model_dir_seed1, "2")  # the last push
            assert await versions() == ["2", "1"]  # what the fault matrix found
            end = await leave_engines_on_final_weights(pool, [a, b], 2, export, timeout_s=30)
            assert (end, await versions(), exports) == ((), ["2", "2"], [])
            # the last push went by broadcast: b, a member then, has no copy on disk to get
            await sync_weights_to_engines([a], tiny_model_dir, "3")
            a.expected_weights = b.expected_weights = (None, "3")  # as engines/refit.py records
            await send.send(("down", b.url))
            await wait_for(lambda: not pool.statistics().engines[1].healthy)
            end = await leave_engines_on_final_weights(pool, [a, b], 3, export, timeout_s=30)
            assert (end, await versions(), exports) == ((), ["3", "3"], [1])
            doomed.cancel()  # gone for good: waited for up to the bound, then named
            await send.send(("down", b.url))
            await wait_for(lambda: not pool.statistics().engines[1].healthy)
            end = await leave_engines_on_final_weights(pool, [a, b], 3, export, timeout_s=1.0)
            assert end == (b.url,)
        nursery.cancel_scope.cancel()
