"""Issue 26 items 3, 5, 7: a stalled `/generate` re-sent to another engine long before the HTTP
timeout, exactly once; the pause lease renewed by the sync that holds it; syncs that skip
engines the pool knows are down. Real local engines; the stall comes from the fault proxy."""

from __future__ import annotations

import trio
from test_engine_pool import run_engine

from engines import (
    EnginePool,
    SGLangEngine,
    find_free_port,
    pause_engines,
    sync_weights_to_engines,
)
from engines.http import EngineTimeouts
from engines.testing.fault_proxy import FaultPlan, FaultProxy

SHORT = {"max_new_tokens": 4}


# A stall bound of 1 + 0.25 × 4 = 2 s for SHORT's 4 tokens; probes too rare to interfere.
STALL_2S = {"probe_interval_s": 60, "stall_floor_s": 1.0, "stall_s_per_token": 0.25}


async def hung_and_good_engines(nursery: trio.Nursery, model_dir) -> tuple[FaultProxy, str, str]:
    """Two local engines, the first behind a proxy whose first /generate hangs: (the proxy,
    its URL, the other engine's URL)."""
    hung, good = [await nursery.start(run_engine, model_dir, find_free_port()) for _ in range(2)]
    proxy = FaultProxy(hung.url, FaultPlan(script=("hang",), hang_s=60.0))
    return proxy, await nursery.start(proxy.serve), good.url


async def test_a_stalled_generate_is_resent_to_a_healthy_engine_within_its_token_bound(
    tiny_model_dir,
):
    # Issue 26 item 3: one hung /generate held the step for generate_timeout_s (600 s) with a
    # healthy, idle engine beside it.
    async with trio.open_nursery() as nursery:
        proxy, proxy_url, good_url = await hung_and_good_engines(nursery, tiny_model_dir)
        slow_http = EngineTimeouts(generate_s=600.0)  # what the run had: only the stall bound helps
        async with (
            SGLangEngine(proxy_url, max_retries=0, timeouts=slow_http) as a,
            SGLangEngine(good_url, max_retries=0, timeouts=slow_http) as b,
            EnginePool([a, b], **STALL_2S) as pool,
        ):  # fmt: skip
            t0 = trio.current_time()
            with trio.fail_after(30):
                result = await pool.generate([1, 2, 3], SHORT, rid="stall-r0.")
            took = trio.current_time() - t0
            stats = pool.statistics().engines
        print(f"stall bound 2.0 s; sent, stalled, aborted, re-sent and answered in {took:.2f} s")
        assert result.completion_tokens == 4
        assert proxy.counts["hang"] == 1  # the first engine got it and hung
        assert stats[0].failures == {"stalled": 1} and stats[0].done == 0
        assert stats[1].done == 1  # answered once, by the other engine
        # not before the stall bound; and long before the proxy's 60 s hang or the 600 s HTTP
        # timeout (the 8 s leave a loaded machine room for the abort, re-send and answer)
        assert 2.0 <= took < 8.0
        nursery.cancel_scope.cancel()


class SlowUpdate(SGLangEngine):
    """A real client whose weight update takes `update_s` longer: a long sync."""

    update_s = 2.5

    async def update_weights_from_disk(self, *args, **kwargs):
        await trio.sleep(self.update_s)
        return await super().update_weights_from_disk(*args, **kwargs)


async def test_a_pause_left_by_a_dead_trainer_ends_within_its_lease(local_engine, caplog):
    # Issue 26 item 5: a trainer killed during a weight sync left the engine paused, and every
    # other client's /generate hung until a later run pushed weights again.
    server, other = local_engine
    async with SGLangEngine(server.url, max_retries=0, pause_lease_s=1.0) as trainer:
        await pause_engines([trainer])  # then the trainer dies: no resume, no more renewals
    assert server.state.scheduler.paused
    t0 = trio.current_time()
    with trio.fail_after(20), caplog.at_level("WARNING"):
        result = await other.generate([1, 2, 3], {"max_new_tokens": 2})
    # held for the lease, then served: without the lease it would hang (to the fail_after)
    assert len(result.output_ids) == 2 and 1.0 <= trio.current_time() - t0 < 6.0
    assert "pause lease of 1.0 s expired" in caplog.text


async def test_a_long_sync_keeps_its_pause_past_the_lease_by_renewing_it(
    local_engine, tiny_model_dir
):
    server, other = local_engine
    done = trio.Event()

    async def generate() -> None:
        await other.generate([1, 2, 3], {"max_new_tokens": 2})
        done.set()

    async with (
        SlowUpdate(server.url, max_retries=0, pause_lease_s=1.0) as trainer,
        trio.open_nursery() as nursery,
    ):
        with trio.fail_after(15):
            await pause_engines([trainer])
            nursery.start_soon(generate)  # held behind the pause until the sync resumes
            sync = trio.Event()

            async def run_sync() -> None:
                await sync_weights_to_engines([trainer], tiny_model_dir, "v1", paused=True)
                sync.set()

            nursery.start_soon(run_sync)
            await trio.sleep(2.0)  # two leases: without renewals the engine resumed at 1 s
            assert server.state.scheduler.paused and not done.is_set()
            await sync.wait()
            await done.wait()
        assert (await other.model_info()).weight_version == "v1"


async def test_a_sync_skips_an_engine_the_pool_knows_is_down_without_paying_its_retries(
    tiny_model_dir,
):
    # Issue 26 item 7: each sync retried a dead engine (0.5 + 1 + 2 s per route: an 8 s step).
    async with trio.open_nursery() as nursery:
        doomed = trio.CancelScope()
        gone = trio.Event()  # the doomed engine has closed its socket: a request to it fails

        async def run_doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            try:
                with doomed:
                    await run_engine(tiny_model_dir, find_free_port(), task_status=task_status)
            finally:
                gone.set()

        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        dead = await nursery.start(run_doomed)
        async with (
            SGLangEngine(live.url, retry_generate=False) as a,  # default retries: 0.5, 1, 2 s
            # its retries 2 + 4 + 8 s (default 0.5 + 1 + 2): paying them is far above the bound
            SGLangEngine(dead.url, retry_generate=False, retry_backoff_s=2.0) as b,
            EnginePool([a, b], probe_interval_s=60) as pool,
        ):
            doomed.cancel()
            with trio.fail_after(30):
                await gone.wait()
            with trio.fail_after(10):
                for i in range(2):  # one of them meets the dead engine: marked down
                    await pool.generate([1, 2], SHORT, rid=f"down-r{i}.")
            assert [e.healthy for e in pool.statistics().engines] == [True, False]
            t0 = trio.current_time()
            with trio.fail_after(60):
                await pause_engines([a, b])
                await sync_weights_to_engines([a, b], tiny_model_dir, "v1", paused=True)
            took = trio.current_time() - t0
            print(f"pause + sync with one engine known down: {took:.2f} s")
            # waiting out the dead engine's retries takes 2 + 4 + 8 s: 7 s fails that and leaves
            # room for a loaded machine (xdist workers beside torchrun jobs; ~0.5 s here)
            assert took < 7.0 and (await a.model_info()).weight_version == "v1"
            assert b.expected_weights[1] == "v1"  # given on rejoin
        nursery.cancel_scope.cancel()
