"""The client side of LoRA against real LoRA-enabled local engines: `sync_lora_to_engines`
(versioned names, keep rule, active adapter, weight version, refusals), `EnginePool` giving
a returning engine the active adapter, failover when a restarted engine lost it, the router's
gateway path, and `launch_engine(lora=LoraLaunch(...))` passing SGLang's flags
(`--enable-lora --max-lora-rank R --lora-target-modules ... --max-loras-per-batch K`, as
`srt/arg_groups/fields/lora.py` of SGLang 0.5.23 defines them).
"""

from __future__ import annotations

import pytest
import trio
from lora_helpers import (  # noqa: F401  (fixtures)
    GREEDY,
    PROMPTS,
    adapters_fixture,
    assert_matches,
    loaded_on,
    references_fixture,
    run_engine,
)

from engines import (
    EnginePool,
    LoraAdapterError,
    LoraLaunch,
    SGLangEngine,
    WeightSyncError,
    find_free_port,
    lora_version_name,
    sync_lora_to_engines,
)


async def gone(engine: SGLangEngine) -> None:
    """Until the engine no longer answers (its server task was cancelled)."""
    with trio.fail_after(10):
        while await engine.is_healthy():
            await trio.sleep(0.01)


async def test_sync_lora_keeps_the_newest_and_generation_uses_the_active_one(
    tiny_model_dir, adapters, references
):
    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        for port in ports:
            await nursery.start(run_engine, tiny_model_dir, port)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        async with SGLangEngine(urls[0], max_retries=0) as a, SGLangEngine(
            urls[1], max_retries=0
        ) as b:  # fmt: skip
            pushes = ["a1", "a2", "a1", "a2"]  # the adapter directory of each version
            for version, which in enumerate(pushes, start=1):
                name = lora_version_name("policy", version)
                duration = await sync_lora_to_engines(
                    [a, b], adapters[which], name, f"v{version}", keep=2
                )
                assert duration > 0
                for engine, url in ((a, urls[0]), (b, urls[1])):
                    assert engine.active_lora == name
                    assert (await engine.model_info()).weight_version == f"v{version}"
                    expected = [lora_version_name("policy", v) for v in (version - 1, version)]
                    assert sorted(await loaded_on(url)) == sorted(
                        n for n in expected if "v0" not in n
                    )
                    # no lora_path: the active adapter; explicit None: the base model
                    assert_matches(await engine.generate(PROMPTS[0], GREEDY), references[which, 0])
                    assert_matches(
                        await engine.generate(PROMPTS[0], GREEDY, lora_path=None),
                        references[None, 0],
                    )
            # a refused push names the engines and leaves the active adapter as it was
            with pytest.raises(WeightSyncError, match="adapter_config.json") as info:
                await sync_lora_to_engines(
                    [a, b], adapters["a1"].parent / "none", "policy-v9", "v9"
                )
            assert urls[0] in str(info.value) and urls[1] in str(info.value)
            assert a.active_lora == b.active_lora == "policy-v4"
        nursery.cancel_scope.cancel()


async def test_an_engine_down_during_a_lora_sync_gets_the_adapter_when_it_returns(
    tiny_model_dir, adapters, references
):
    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        await nursery.start(run_engine, tiny_model_dir, ports[0])
        doomed = trio.CancelScope()

        async def run_doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with doomed:
                await run_engine(tiny_model_dir, ports[1], task_status=task_status)

        await nursery.start(run_doomed)
        a = SGLangEngine(f"http://127.0.0.1:{ports[0]}", max_retries=0)
        b = SGLangEngine(f"http://127.0.0.1:{ports[1]}", max_retries=0)
        async with a, b, EnginePool([a, b], probe_interval_s=0.1) as pool:
            await sync_lora_to_engines([a, b], adapters["a1"], "policy-v1", "v1")
            doomed.cancel()
            await gone(b)
            await sync_lora_to_engines([a, b], adapters["a2"], "policy-v2", "v2")  # b is down
            assert pool.active_lora == "policy-v2"
            await nursery.start(run_engine, tiny_model_dir, ports[1])  # back, without adapters
            with trio.fail_after(30):  # `healthy` alone can still be the pre-restart state
                while not (s := pool.statistics().engines[1]).healthy or s.rejoined < 1:
                    await trio.sleep(0.05)
            assert await loaded_on(b.url) == {"policy-v2": str(adapters["a2"])}
            assert (await b.model_info()).weight_version == "v2"
            for _ in range(4):
                assert_matches(await pool.generate(PROMPTS[2], GREEDY), references["a2", 2])
        nursery.cancel_scope.cancel()


def test_launch_flags_are_sglangs():
    assert LoraLaunch(8).args() == [
        "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
        "--max-loras-per-batch", "8",
    ]  # fmt: skip
    assert LoraLaunch(4, ["q_proj", "v_proj"], max_loras_per_batch=3).args()[4:7] == [
        "q_proj", "v_proj", "--max-loras-per-batch"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoraLaunch(0)
    assert lora_version_name("policy", 3) == "policy-v3"
    args = LoraLaunch(8, "all-linear").args()  # peft's spelling becomes SGLang's
    assert "all" in args and "all-linear" not in args


async def test_launch_engine_passes_the_lora_flags_to_the_local_engine(
    tiny_model_dir, adapters, references, tmp_path
):
    from engines import launch_engine

    lora = LoraLaunch(max_lora_rank=8, max_loras_per_batch=3)
    async with (
        launch_engine(kind="local", model_path=tiny_model_dir, log_path=tmp_path / "e.log",
                      lora=lora) as launched,
        SGLangEngine(launched.url, max_retries=0) as engine,
    ):  # fmt: skip
        info = await engine.server_info()
        assert (info["enable_lora"], info["max_lora_rank"], info["max_loras_per_batch"]) == (
            True, 8, 3,
        )  # fmt: skip
        assert info["lora_target_modules"] == ["all"]
        await engine.load_lora_adapter("a2", adapters["a2"])
        assert_matches(await engine.generate(PROMPTS[1], GREEDY, lora_path="a2"),
                       references["a2", 1])  # fmt: skip
        with pytest.raises(LoraAdapterError, match="rank 16"):
            await engine.load_lora_adapter("big", adapters["rank16"])


async def test_the_router_sends_the_workers_active_adapter_through_the_gateway(
    tiny_model_dir, adapters, references
):
    from engines.router import RouterEngine
    from engines.testing.gateway import open_gateway

    async with trio.open_nursery() as nursery:
        workers = [await nursery.start(run_engine, tiny_model_dir, find_free_port())
                   for _ in range(2)]  # fmt: skip
        clients = [SGLangEngine(w.url, max_retries=0) for w in workers]
        async with (
            open_gateway([w.url for w in workers]) as (url, _),
            RouterEngine(SGLangEngine(url, max_retries=0), clients) as router,
            clients[0],
            clients[1],
        ):
            await sync_lora_to_engines(router.workers, adapters["a1"], "policy-v1", "v1")
            assert router.active_lora == "policy-v1"
            assert_matches(await router.generate(PROMPTS[0], GREEDY), references["a1", 0])
            batch = await router.generate_batch(
                [PROMPTS[1], PROMPTS[1]], GREEDY, lora_path=["policy-v1", None]
            )
            assert_matches(batch[0], references["a1", 1])
            assert_matches(batch[1], references[None, 1])
        nursery.cancel_scope.cancel()


async def test_a_request_to_an_engine_restarted_without_its_adapter_fails_over(
    tiny_model_dir, adapters, references
):
    """Before the prober notices a restart, the engine answers 400 "never been loaded" for the
    active adapter: the pool treats that as stale weights and retries on another engine."""
    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        await nursery.start(run_engine, tiny_model_dir, ports[0])
        doomed = trio.CancelScope()

        async def run_doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with doomed:
                await run_engine(tiny_model_dir, ports[1], task_status=task_status)

        await nursery.start(run_doomed)
        a = SGLangEngine(f"http://127.0.0.1:{ports[0]}", max_retries=0)
        b = SGLangEngine(f"http://127.0.0.1:{ports[1]}", max_retries=0)
        async with a, b, EnginePool([a, b], probe_interval_s=600) as pool:
            await sync_lora_to_engines([a, b], adapters["a1"], "policy-v1", "v1")
            doomed.cancel()
            await gone(b)
            await nursery.start(run_engine, tiny_model_dir, ports[1])  # back, no adapter
            for _ in range(4):
                assert_matches(await pool.generate(PROMPTS[0], GREEDY), references["a1", 0])
            stats = pool.statistics().engines
            assert stats[1].failures == {"stale weights": 1} and not stats[1].healthy
            assert stats[0].done == 4
        nursery.cancel_scope.cancel()


async def test_requests_sent_during_a_push_run_on_the_new_adapter_under_its_version(
    tiny_model_dir, adapters, references
):
    """The RL loop's push: `pause_engines(activate_lora=new)`, then the sync in the background.
    A request sent in between names the new adapter, waits in the engine, and runs on it
    once the sync resumes the engine: its tokens and its weight version agree."""
    from engines import pause_engines

    port = find_free_port()
    async with trio.open_nursery() as nursery:
        server = await nursery.start(run_engine, tiny_model_dir, port)
        async with SGLangEngine(server.url, max_retries=0) as engine:
            await sync_lora_to_engines([engine], adapters["a1"], "policy-v1", "1")
            await pause_engines([engine], "in_place", activate_lora="policy-v2")
            results = []

            async def rollout() -> None:
                results.append(await engine.generate(PROMPTS[1], GREEDY))

            async with trio.open_nursery() as requests:
                requests.start_soon(rollout)
                with trio.fail_after(10):
                    while not server.state.scheduler.held:
                        await trio.sleep(0.01)
                await sync_lora_to_engines([engine], adapters["a2"], "policy-v2", "2",
                                           paused=True)  # fmt: skip
            assert_matches(results[0], references["a2", 1])
            assert results[0].weight_version == "2"

            # a refused push: the engine goes back to the newest adapter it has
            await pause_engines([engine], "in_place", activate_lora="policy-v3")
            with pytest.raises(WeightSyncError):
                await sync_lora_to_engines([engine], adapters["a1"].parent / "none",
                                           "policy-v3", "3", paused=True)  # fmt: skip
            assert engine.active_lora == "policy-v2"
            assert_matches(await engine.generate(PROMPTS[1], GREEDY), references["a2", 1])
        nursery.cancel_scope.cancel()
