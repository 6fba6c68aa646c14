"""Issue 26 items 3, 5, 7: a stalled `/generate` re-sent to another engine long before the HTTP
timeout, exactly once; the pause lease renewed by the sync that holds it; syncs that skip
engines the pool knows are down. Real local engines; the stall comes from the fault proxy."""

from __future__ import annotations

import trio
from test_engine_pool import run_engine

from engines import EnginePool, SGLangEngine, find_free_port
from engines.http import EngineTimeouts
from engines.testing.fault_proxy import FaultPlan, FaultProxy

SHORT = {"max_new_tokens": 4}


async def test_a_stalled_generate_is_resent_to_a_healthy_engine_within_its_token_bound(
    tiny_model_dir,
):
    # Issue 26 item 3: one hung /generate held the step for generate_timeout_s (600 s) with a
    # healthy, idle engine beside it.
    async with trio.open_nursery() as nursery:
        hung, good = [await nursery.start(run_engine, tiny_model_dir, find_free_port())
                      for _ in range(2)]  # fmt: skip
        proxy = FaultProxy(hung.url, FaultPlan(script=("hang",), hang_s=60.0))
        proxy_url = await nursery.start(proxy.serve)
        slow_http = EngineTimeouts(generate_s=600.0)  # what the run had: only the stall bound helps
        async with (
            SGLangEngine(proxy_url, max_retries=0, timeouts=slow_http) as a,
            SGLangEngine(good.url, max_retries=0, timeouts=slow_http) as b,
            EnginePool([a, b], probe_interval_s=60, stall_floor_s=1.0,
                       stall_s_per_token=0.25) as pool,  # bound: 1 + 0.25 × 4 = 2 s
        ):  # fmt: skip
            t0 = trio.current_time()
            with trio.fail_after(15):
                result = await pool.generate([1, 2, 3], SHORT, rid="stall-r0.")
            took = trio.current_time() - t0
            stats = pool.statistics().engines
        print(f"stall bound 2.0 s; sent, stalled, aborted, re-sent and answered in {took:.2f} s")
        assert result.completion_tokens == 4
        assert proxy.counts["hang"] == 1  # the first engine got it and hung
        assert stats[0].failures == {"stalled": 1} and stats[0].done == 0
        assert stats[1].done == 1  # answered once, by the other engine
        assert 2.0 <= took < 5.0
        nursery.cancel_scope.cancel()
