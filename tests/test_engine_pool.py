"""`EnginePool` over two real local engines: least-outstanding routing, failover when an engine
dies mid-request (retried once elsewhere, never duplicated), probing it back."""

from __future__ import annotations

import pytest
import trio

from engines import EnginePool, EngineUnavailableError, SGLangEngine, find_free_port
from engines.local import open_local_engine

LONG = {"max_new_tokens": 60, "ignore_eos": True}


async def run_engine(model_dir, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A local engine on `port` until this task is cancelled (cancelling = the engine dies)."""
    async with open_local_engine(model_dir, port=port, num_threads=1) as server:
        task_status.started(server)
        await trio.sleep_forever()


async def wait_for(predicate, timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


def client(port: int) -> SGLangEngine:
    return SGLangEngine(f"http://127.0.0.1:{port}", max_retries=1, retry_backoff_s=0.05)


async def test_requests_go_to_the_engine_with_fewest_outstanding(tiny_model_dir):
    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        for port in ports:
            await nursery.start(run_engine, tiny_model_dir, port)
        async with client(ports[0]) as a, client(ports[1]) as b, EnginePool([a, b]) as pool:
            results = []

            async def one(i: int) -> None:
                results.append(await pool.generate([i + 1, 2, 3], LONG, rid=f"r{i}"))

            async with trio.open_nursery() as requests:
                for i in range(8):
                    requests.start_soon(one, i)
                await wait_for(lambda: pool.statistics().in_flight == 8)
                assert [e.in_flight for e in pool.statistics().engines] == [4, 4]
            stats = pool.statistics()
            assert [e.done for e in stats.engines] == [4, 4] and stats.in_flight == 0
            assert len(results) == 8 and all(len(r.output_ids) == 60 for r in results)
        nursery.cancel_scope.cancel()


async def test_requests_on_a_dying_engine_are_retried_elsewhere_once_and_never_duplicated(
    tiny_model_dir,
):
    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        await nursery.start(run_engine, tiny_model_dir, ports[0])
        doomed = trio.CancelScope()

        async def run_doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with doomed:
                await run_engine(tiny_model_dir, ports[1], task_status=task_status)

        await nursery.start(run_doomed)
        async with (
            client(ports[0]) as a,
            client(ports[1]) as b,
            EnginePool([a, b], probe_interval_s=0.1) as pool,
        ):
            results = []
            slow = {"max_new_tokens": 200, "ignore_eos": True}

            async def one(i: int) -> None:
                results.append(await pool.generate([i + 1, 2, 3], slow, rid=f"r{i}"))

            async with trio.open_nursery() as requests:
                for i in range(8):
                    requests.start_soon(one, i)
                await wait_for(lambda: pool.statistics().in_flight == 8)
                doomed.cancel()  # engine b dies with 4 requests in flight
            stats = pool.statistics()
            assert len(results) == 8 and sorted(r.rid for r in results) == sorted(
                f"r{i}" for i in range(8)
            )
            assert all(
                r.finish_reason.type == "length" and len(r.output_ids) == 200 for r in results
            )
            assert (stats.engines[0].done, stats.engines[1].failed, stats.engines[1].done) == (
                8,
                4,
                0,
            )
            assert not stats.engines[1].healthy

            # b comes back on the same port: the prober marks it up and it takes requests again
            await nursery.start(run_engine, tiny_model_dir, ports[1])
            await wait_for(lambda: pool.statistics().engines[1].healthy)
            async with trio.open_nursery() as requests:
                for _ in range(4):
                    requests.start_soon(
                        pool.generate, [5, 6], {"max_new_tokens": 20, "ignore_eos": True}
                    )
            assert pool.statistics().engines[1].done >= 1
        nursery.cancel_scope.cancel()


async def test_no_engine_left_raises_unavailable_naming_the_failures():
    dead = client(find_free_port())
    async with dead, EnginePool([dead], unavailable_timeout_s=0.5) as pool:
        with pytest.raises(
            EngineUnavailableError,
            match=r"in 0\.5 s \(engines\.unavailable_timeout_s=0\.5.*unreachable",
        ):
            await pool.generate([1, 2], {"max_new_tokens": 2})
        stats = pool.statistics()
        assert stats.failed == 1 and not stats.engines[0].healthy


async def test_an_error_in_the_pool_body_is_not_wrapped_in_a_group():
    dead = client(find_free_port())
    with pytest.raises(KeyError):
        async with dead, EnginePool([dead]):
            raise KeyError("body")


async def test_a_batch_goes_to_one_engine_and_each_item_can_be_aborted_by_rid(tiny_model_dir):
    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        for port in ports:
            await nursery.start(run_engine, tiny_model_dir, port)
        async with client(ports[0]) as a, client(ports[1]) as b, EnginePool([a, b]) as pool:
            results = []

            async def batch() -> None:
                long = {"max_new_tokens": 400, "ignore_eos": True}
                results.extend(
                    await pool.generate_batch([[5, 6, 7]] * 3, long, rids=["x0", "x1", "x2"])
                )

            async with trio.open_nursery() as requests:
                requests.start_soon(batch)
                await wait_for(lambda: pool.statistics().in_flight == 3)  # weighs 3 requests
                assert sorted(e.in_flight for e in pool.statistics().engines) == [0, 3]
                await pool.abort("x1")
            assert [r.finish_reason.type for r in results] == ["length", "abort", "length"]
            assert pool.statistics().in_flight == 0
        nursery.cancel_scope.cancel()
