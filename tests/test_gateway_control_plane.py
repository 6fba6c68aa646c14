"""Issue 25 item 4: smg's RL control plane (`/v1/rl/*`), `url@rank` worker lists and
`/server_info` through the gateway. The gateway is the in-repo imitation; the workers are real
local engines that require an API key only the gateway knows, so any call the trainer made to
them directly would fail with 401: a sync that succeeds went through the gateway."""

from __future__ import annotations

import pytest
import trio

from engines import EngineError, SGLangEngine, find_free_port, sync_weights_to_engines
from engines.control_plane import GatewayControl, choose_control_plane, control_targets
from engines.local.server import open_local_engine
from engines.router import RouterEngine
from engines.testing.gateway import open_gateway
from engines.types import WeightSyncError

SECRET = "only-the-gateway-knows"


async def run_keyed_engine(model_dir, *, admin_api_key=None, task_status=trio.TASK_STATUS_IGNORED):
    async with open_local_engine(model_dir, port=find_free_port(), num_threads=1,
                                 api_key=SECRET, admin_api_key=admin_api_key) as server:  # fmt: skip
        task_status.started(server)
        await trio.sleep_forever()


def test_url_at_rank_lists_give_one_control_target_per_url():
    listed = ["http://a:1@0", "http://a:1@1", "http://b:2/", "http://u@c:3@1", "http://u@c:3"]
    assert control_targets(listed) == ["http://a:1", "http://b:2", "http://u@c:3"]


async def test_a_sync_through_the_gateway_control_plane_reaches_workers_the_trainer_cannot(
    tiny_model_dir, tiny_model_dir_seed1
):
    async with trio.open_nursery() as nursery:
        workers = [await nursery.start(run_keyed_engine, tiny_model_dir) for _ in range(2)]
        urls = [w.url for w in workers]
        async with open_gateway([f"{u}@{r}" for u in urls for r in (0, 1)],
                                worker_api_key=SECRET) as (gw, stats):  # fmt: skip
            assert await choose_control_plane("auto", urls) == "gateway"  # 401 without the key
            assert await choose_control_plane("auto", urls, api_key=SECRET) == "direct"
            gateway = SGLangEngine(gw, max_retries=0)
            control = GatewayControl(gateway)
            async with RouterEngine(gateway, [control]) as router:
                listed = await control.workers()
                assert [w["url"] for w in listed] == urls and {w["dp_ranks"] for w in listed} == {2}
                await sync_weights_to_engines([control], tiny_model_dir_seed1, "1")
                assert [w.state.weight_version for w in workers] == ["1", "1"]
                assert {w["weight_version"] for w in await control.workers()} == {"1"}
                answers = [await router.generate([3, 4], {"max_new_tokens": 2}) for _ in range(4)]
                assert {r.weight_version for r in answers} == {"1"}
                assert sorted(stats.forwarded.values()) == [2, 2]
        nursery.cancel_scope.cancel()


async def test_a_worker_that_fails_through_the_control_plane_is_named_in_the_error(
    tiny_model_dir, tiny_model_dir_seed1
):
    async with trio.open_nursery() as nursery:
        good = await nursery.start(run_keyed_engine, tiny_model_dir)
        bad = await nursery.start(  # its control routes take another key: they answer 401
            lambda task_status: run_keyed_engine(tiny_model_dir, admin_api_key="other",
                                                 task_status=task_status))  # fmt: skip
        async with (
            open_gateway([good.url, bad.url], worker_api_key=SECRET) as (gw, _),
            SGLangEngine(gw, max_retries=0) as gateway,
        ):
            control = GatewayControl(gateway)
            with pytest.raises(EngineError) as report:  # 207: one worker failed
                await control.fanout("update_weights_from_disk",
                                     {"model_path": str(tiny_model_dir_seed1), "weight_version": "7"})  # fmt: skip
            assert bad.url in str(report.value) and good.url not in str(report.value)
            assert "worker-1" in str(report.value) and report.value.status == 401
            assert good.state.weight_version == "7" and bad.state.weight_version != "7"
            with pytest.raises(WeightSyncError, match=bad.url):
                await sync_weights_to_engines([control], tiny_model_dir_seed1, "8")
            assert not good.state.scheduler.paused  # resumed through the gateway after the failure
        nursery.cancel_scope.cancel()


async def test_server_info_through_the_gateway_falls_back_to_a_worker_version(tiny_model_dir):
    async with trio.open_nursery() as nursery:
        worker = await nursery.start(run_keyed_engine, tiny_model_dir)
        async with (
            open_gateway([worker.url], worker_api_key=SECRET, server_info_version=False) as (gw, _),
            SGLangEngine(gw, max_retries=0) as gateway,
        ):
            assert "version" not in await gateway.server_info()
            router = RouterEngine(gateway, [GatewayControl(gateway)])
            info = await router.server_info()
            assert info["version"] and info["version_from"] == worker.url
            assert await router.check_server() == info["version"]
        nursery.cancel_scope.cancel()


async def test_run_rl_with_router_url_refits_workers_only_the_gateway_can_reach(
    tiny_model_dir, tmp_path
):
    """The CLI end to end with `engines.control_plane: auto`: the workers answer the trainer
    401, so every weight sync (the initial push, then one per step) goes through `/v1/rl/*`."""
    from test_run_rl_cli import two_step_run

    async with trio.open_nursery() as nursery:
        workers = [await nursery.start(run_keyed_engine, tiny_model_dir) for _ in range(2)]
        async with open_gateway([w.url for w in workers], worker_api_key=SECRET) as (gw, stats):
            proc = await trio.to_thread.run_sync(
                lambda: two_step_run(tiny_model_dir, tmp_path, "--router-url", gw)
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            versions = [w.state.weight_version for w in workers]
        nursery.cancel_scope.cancel()
    assert versions == ["2", "2"]
    assert sum(stats.forwarded.values()) >= 8  # generation went through the gateway too
