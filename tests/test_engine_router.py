"""Issue 12 item 3: generation through sgl-model-gateway, control calls to each worker. The gateway
is the in-repo imitation (`engines.testing.gateway`: one string rid per request, 404 on the
control routes), the workers are real local engines."""

from __future__ import annotations

import json

import pytest
import trio
from test_engine_pool import run_engine
from test_run_rl_cli import two_step_run

from engines import EngineError, SGLangEngine, find_free_port, sync_weights_to_engines
from engines.router import RouterEngine
from engines.testing.gateway import open_gateway

LONG = {"max_new_tokens": 1000, "ignore_eos": True}


async def test_the_gateway_refuses_what_a_plain_client_sends_it(tiny_model_dir):
    async with trio.open_nursery() as nursery:
        worker = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        async with (
            open_gateway([worker.url]) as (url, stats),
            SGLangEngine(url, max_retries=0) as e,
        ):
            with pytest.raises(EngineError) as batch:
                await e.generate_batch([[1, 2]] * 2, {"max_new_tokens": 2}, rids=["a.", "b."])
            assert batch.value.status == 400 and stats.refused == 1
            for control in (e.pause(), e.abort("a."), e.update_weights_from_disk(tiny_model_dir)):
                with pytest.raises(EngineError) as missing:
                    await control
                assert missing.value.status == 404
        nursery.cancel_scope.cancel()


async def test_generation_goes_through_the_gateway_and_control_to_each_worker(
    tiny_model_dir, tiny_model_dir_seed1
):
    async with trio.open_nursery() as nursery:
        workers = [await nursery.start(run_engine, tiny_model_dir, find_free_port())
                   for _ in range(2)]  # fmt: skip
        async with open_gateway([w.url for w in workers]) as (url, stats):
            router = RouterEngine(SGLangEngine(url, max_retries=0))
            async with router:
                listed = await router.list_workers()
                assert listed == [w.url for w in workers]
                clients = [SGLangEngine(u, max_retries=0) for u in listed]
                for client in clients:
                    await client.__aenter__()
                router.workers = clients
                rids = [f"g-{i}." for i in range(4)]
                results = await router.generate_batch([[3, 4, 5]] * 4, {"max_new_tokens": 3},
                                                      rids=rids)  # fmt: skip
                assert [r.rid for r in results] == rids and stats.refused == 0
                assert sorted(stats.forwarded.values()) == [2, 2]  # one request per sample

                await sync_weights_to_engines(router.workers, tiny_model_dir_seed1, "1")
                assert [(await c.model_info()).weight_version for c in clients] == ["1", "1"]
                assert (await router.generate([3, 4], {"max_new_tokens": 2})).weight_version == "1"

                aborted = []

                async def long(rid: str) -> None:
                    aborted.append((await router.generate([3, 4], LONG, rid=rid)).finish_reason)

                async with trio.open_nursery() as requests:
                    requests.start_soon(long, "long-1.")
                    await trio.sleep(0.3)
                    await router.abort("long-1.")  # sent to every worker
                assert aborted[0].type == "abort"
                for client in clients:
                    await client.__aexit__(None, None, None)
        nursery.cancel_scope.cancel()


async def test_run_rl_with_router_url_trains_and_pushes_weights_to_each_worker(
    tiny_model_dir, tmp_path
):
    async with trio.open_nursery() as nursery:
        workers = [await nursery.start(run_engine, tiny_model_dir, find_free_port())
                   for _ in range(2)]  # fmt: skip
        async with open_gateway([w.url for w in workers]) as (url, stats):
            proc = await trio.to_thread.run_sync(
                lambda: two_step_run(tiny_model_dir, tmp_path, "--router-url", url)
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            versions = [w.state.weight_version for w in workers]
            forwarded = dict(stats.forwarded)
        nursery.cancel_scope.cancel()
    assert versions == ["2", "2"]  # initial push (0), then one sync per step, on each worker
    assert stats.refused == 0 and len(forwarded) == 2 and sum(forwarded.values()) >= 8
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rows] == [1, 2]


async def test_a_worker_restarted_behind_the_gateway_never_serves_old_weights(
    tiny_model_dir, tiny_model_dir_seed1
):
    from test_engine_pool import wait_for

    from engines import EnginePool

    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        await nursery.start(run_engine, tiny_model_dir, ports[0])
        doomed = trio.CancelScope()

        async def run_doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with doomed:
                await run_engine(tiny_model_dir, ports[1], task_status=task_status)

        await nursery.start(run_doomed)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        async with (
            open_gateway(urls) as (url, _),
            SGLangEngine(urls[0], max_retries=0) as a,
            SGLangEngine(urls[1], max_retries=0) as b,
            RouterEngine(SGLangEngine(url, max_retries=0), [a, b]) as router,
        ):
            await sync_weights_to_engines([a, b], tiny_model_dir_seed1, "1")
            doomed.cancel()
            restarted = await nursery.start(run_engine, tiny_model_dir, ports[1])  # on "0"
            results = [await router.generate([3, 4], {"max_new_tokens": 2}) for _ in range(6)]
            assert {r.weight_version for r in results} == {"1"}  # stale answers re-sent
            async with EnginePool([a, b], probe_interval_s=0.1) as pool:  # gives it "1"
                await wait_for(lambda: pool.statistics().engines[1].rejoined == 1, 30)
            assert restarted.state.weight_version == "1"
        nursery.cancel_scope.cancel()
