"""SGLang 0.5.23 protocol points (issue 12 items 1, 2, 4–11, 16) against the local engine, which
follows 0.5.23 on each of them: relative weight paths, the refused flush under an in-place pause,
info routes and the minimum version, `no_stop_trim`, rid-prefix aborts, the paused health probe,
the admin key, the flush before an update, and answers that are not JSON."""

from __future__ import annotations

import shutil

import httpx
import pytest
import trio
from test_engine_local import wait_for

from engines import EngineError, SGLangEngine, launch_engine, sync_weights_to_engines
from engines.local import open_local_engine
from engines.types import MIN_SGLANG_VERSION
from rollouts.request_ids import oldest_version, request_rid


class Recording(httpx.AsyncBaseTransport):
    """Real HTTP to the engine, with each request's path and JSON body noted; optionally the
    first `refuse_flushes` `/flush_cache` calls are answered 400 as a busy SGLang would."""

    def __init__(self, refuse_flushes: int = 0) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.calls: list[tuple[str, bytes]] = []
        self.refuse_flushes = refuse_flushes

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.calls.append((request.url.path, body))
        if request.url.path == "/flush_cache" and self.refuse_flushes > 0:
            self.refuse_flushes -= 1
            return httpx.Response(400, text="Cache not flushed.\n")
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_weight_push_sends_absolute_path(tiny_model_dir, tiny_model_dir_seed1, tmp_path,
                                               monkeypatch):  # fmt: skip
    # The trainer writes runs/x/weights/v1 relative to its cwd; the engine runs elsewhere.
    trainer_dir, engine_dir = tmp_path / "trainer", tmp_path / "engine"
    engine_dir.mkdir()
    shutil.copytree(tiny_model_dir_seed1, trainer_dir / "runs" / "x" / "weights" / "v1")
    monkeypatch.chdir(trainer_dir)
    async with (
        launch_engine(kind="local", model_path=tiny_model_dir, cwd=engine_dir,
                      log_path=tmp_path / "engine.log") as launched,
        SGLangEngine(launched.url, max_retries=0) as engine,
    ):  # fmt: skip
        await engine.update_weights_from_disk("runs/x/weights/v1", "1")
        info = await engine.model_info()
    assert info.weight_version == "1"
    assert info.model_path == str(trainer_dir / "runs" / "x" / "weights" / "v1")


async def test_in_place_update_never_asks_for_a_flush_and_staleness_counts_the_oldest_span(
    tiny_model_dir, tiny_model_dir_seed1
):
    async with (
        open_local_engine(tiny_model_dir, num_threads=1, weight_version="0") as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):
        results = []

        async def run() -> None:
            long = {"max_new_tokens": 80, "ignore_eos": True}
            results.append(await engine.generate([8, 9], long))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await wait_for(lambda: _generated(server, 5))
            # what 0.5.23 does with the update's own flush while requests stay in place
            await engine.pause("in_place")
            with pytest.raises(EngineError, match="cache was not flushed") as refused:
                await engine.update_weights_from_disk(tiny_model_dir_seed1, "1", flush_cache=True)
            assert refused.value.status == 400
            assert (await engine.model_info()).weight_version == "0"
            await engine.resume()
            # the sync never asks for it: the version is set and the request finishes
            await sync_weights_to_engines(
                [engine], tiny_model_dir_seed1, "2", pause_mode="in_place"
            )
        assert (await engine.model_info()).weight_version == "2"
    (result,) = results
    assert result.weight_version == "2" and result.weight_versions[0].version == "0"
    assert oldest_version(result) == 0  # the sample is as stale as its first tokens


async def _generated(server, count: int) -> bool:
    running = server.state.scheduler.running
    return bool(running) and len(running[0].output_ids) >= count


async def test_abort_mode_sync_flushes_first_with_bounded_retries_then_updates_without_flush(
    tiny_model_dir, tiny_model_dir_seed1
):
    recording = Recording(refuse_flushes=2)
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as server,
        SGLangEngine(server.url, max_retries=0, transport=recording) as engine,
    ):
        await sync_weights_to_engines([engine], tiny_model_dir_seed1, "1", flush_retry_s=0.01)
        paths = [p for p, _ in recording.calls]
        assert paths == ["/pause_generation", "/flush_cache", "/flush_cache", "/flush_cache",
                         "/update_weights_from_disk", "/model_info", "/continue_generation"]  # fmt: skip
        update_body = dict(recording.calls)["/update_weights_from_disk"]
        assert b'"flush_cache":false' in update_body.replace(b" ", b"")
        recording.refuse_flushes = 10  # past the bound: the sync fails and names the flush
        with pytest.raises(EngineError, match="cache flush before the weight update failed"):
            await sync_weights_to_engines([engine], tiny_model_dir, "2", flush_retries=2,
                                          flush_retry_s=0.01)  # fmt: skip
        assert (await engine.model_info()).weight_version == "1"
        assert not engine.paused


def _fake_server(version: str | None, *, new_routes: bool):
    """An SGLang server of another release, at the HTTP boundary (not runnable here)."""

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.startswith("/get_") or new_routes:
            if path.endswith("server_info"):
                return httpx.Response(200, json={} if version is None else {"version": version})
            if path.endswith("model_info"):
                return httpx.Response(200, json={"model_path": "m", "weight_version": "7"})
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handle)


async def test_info_routes_fall_back_to_get_forms_and_old_servers_are_refused():
    async with SGLangEngine("http://old", transport=_fake_server("0.5.2", new_routes=False)) as e:
        assert (await e.model_info()).weight_version == "7"  # via /get_model_info
        with pytest.raises(EngineError, match=r"0\.5\.2.*needs SGLang >= 0\.5\.6"):
            await e.check_server()
    async with SGLangEngine("http://none", transport=_fake_server(None, new_routes=True)) as e:
        with pytest.raises(EngineError, match="reports SGLang version '\\(none\\)'"):
            await e.check_server()
    async with SGLangEngine("http://new", transport=_fake_server("0.5.23", new_routes=True)) as e:
        assert await e.check_server() == "0.5.23"
    assert MIN_SGLANG_VERSION == (0, 5, 6)


async def test_local_engine_reports_a_version_the_client_accepts(local_engine):
    _, engine = local_engine
    assert (await engine.check_server()).startswith("0.5.23")


async def test_text_is_the_decoded_output_ids_including_the_stop_token(local_engine,
                                                                       tiny_tokenizer):  # fmt: skip
    _, engine = local_engine
    greedy = {"max_new_tokens": 6, "temperature": 0}
    first = (await engine.generate([5, 6, 7], greedy)).output_ids[0]
    stopped = await engine.generate([5, 6, 7], {**greedy, "stop_token_ids": [first]})
    assert stopped.output_ids == (first,) and stopped.finish_reason.matched == first
    assert stopped.text == tiny_tokenizer.decode([first], skip_special_tokens=True) != ""


def test_rids_are_never_prefixes_of_each_other():
    rids = [request_rid("b1-7-g1", i) for i in range(120)]
    rids += [request_rid("b1-7-g12", i) for i in range(3)]
    rids += [request_rid("b1-7-g1", i, f"t{t}") for i in range(12) for t in range(12)]
    assert len(set(rids)) == len(rids)
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]


async def test_local_engine_aborts_every_rid_the_given_one_starts(local_engine):
    _, engine = local_engine
    long = {"max_new_tokens": 1000, "ignore_eos": True}
    results: dict[str, str] = {}

    async def one(rid: str) -> None:
        results[rid] = (await engine.generate([3, 4], long, rid=rid)).finish_reason.type

    async with trio.open_nursery() as nursery:
        for rid in ("x-1", "x-10", "x-2"):
            nursery.start_soon(one, rid)
        await trio.sleep(0.3)
        await engine.abort("x-1")  # SGLang 0.5.23 matches by prefix: x-10 goes too
        await wait_for(lambda: _done(results, 2))
        await engine.abort("x-2")
    assert results == {"x-1": "abort", "x-10": "abort", "x-2": "abort"}


async def _done(results: dict, count: int) -> bool:
    return len(results) >= count


async def test_paused_engine_is_never_reported_unhealthy(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
        httpx.AsyncClient(base_url=server.url) as http,
    ):
        await engine.pause("abort")
        assert (await http.get("/health_generate")).status_code == 503  # as SGLang 0.5.23
        assert await engine.is_healthy()  # this client paused it: asks /model_info instead
        await engine.resume()
        assert (await http.get("/health_generate")).status_code == 200
        assert await engine.is_healthy()


async def test_an_engine_paused_by_another_process_is_not_reported_unhealthy_once_told(
    tiny_model_dir, monkeypatch
):
    """A rollout worker's client is told (`mark_paused_elsewhere`) that the trainer holds its
    engine paused for a push: its probe must not count the paused engine as down."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as server,
        SGLangEngine(server.url, max_retries=0) as trainer,
        SGLangEngine(server.url, max_retries=0) as worker,
    ):
        await trainer.pause("abort")
        assert not await worker.is_healthy()  # not told: /health_generate answers 503
        worker.mark_paused_elsewhere(True)
        assert await worker.is_healthy()
        await trainer.resume()
        worker.mark_paused_elsewhere(False)
        assert await worker.is_healthy()


async def test_admin_api_key_is_sent_on_control_routes_only(tiny_model_dir):
    async with open_local_engine(tiny_model_dir, num_threads=1, admin_api_key="adm") as server:
        async with SGLangEngine(server.url, max_retries=0) as plain:
            assert (await plain.generate([1, 2], {"max_new_tokens": 2})).completion_tokens == 2
            with pytest.raises(EngineError) as refused:
                await plain.pause()
            assert refused.value.status == 401
        async with SGLangEngine(server.url, max_retries=0, admin_api_key="adm") as admin:
            await admin.pause()
            await admin.resume()
            assert (await admin.generate([1, 2], {"max_new_tokens": 2})).completion_tokens == 2


async def test_a_200_answer_that_is_not_json_is_an_engine_error():
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>proxy says hello</html>")

    async with SGLangEngine("http://proxy", transport=httpx.MockTransport(handle)) as engine:
        with pytest.raises(EngineError, match="not JSON.*proxy says hello"):
            await engine.generate([1, 2], {"max_new_tokens": 2})
        with pytest.raises(EngineError, match="not JSON"):
            await engine.generate_batch([[1, 2]], {"max_new_tokens": 2}, rids=["a."])


async def test_pool_never_marks_a_paused_engine_down(tiny_model_dir, monkeypatch):
    from engines import EnginePool

    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.2")
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
        EnginePool([engine], probe_interval_s=0.05) as pool,
    ):
        await engine.pause("in_place")  # a weight sync in progress, as far as probes go
        engine.expected_weights = ("/elsewhere", "next")  # what the sync will give it
        await trio.sleep(0.5)  # ten probe rounds
        assert pool.statistics().engines[0].healthy
        await engine.resume()  # the sync "ended" without the weights: now it is stale
        await wait_for(lambda: _unhealthy(pool), 10)


async def _unhealthy(pool) -> bool:
    return not pool.statistics().engines[0].healthy


async def test_local_engine_follows_sglang_on_bodies_server_info_and_input_logprobs(local_engine):
    server, engine = local_engine
    async with httpx.AsyncClient(base_url=server.url) as http:
        for path in ("/pause_generation", "/continue_generation"):  # FastAPI: body required
            response = await http.post(path)
            assert response.status_code == 400 and "Field required" in response.json()["message"]
        assert (await http.post("/continue_generation", json={})).status_code == 200
        for bad in ({"flush_cache": "maybe"}, {"abort_all_requests": 2}, {"load_format": 3}):
            response = await http.post(
                "/update_weights_from_disk", json={"model_path": "/nowhere", **bad}
            )
            assert response.status_code == 400 and response.json()["type"] == "Bad Request"
        await engine.update_weight_version("v7")
        assert (await engine.server_info())["weight_version"] == "v7"
        body = {"input_ids": list(range(5, 25)), "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
        at = {}
        for t in (1.0, 0.5):
            body["sampling_params"]["temperature"] = t
            out = (await http.post("/generate", json={**body, "extra_key": str(t)})).json()
            at[t] = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
        assert at[1.0] == pytest.approx(at[0.5], abs=1e-6)  # raw logits, as SGLang returns
    with pytest.raises(ValueError, match="not temperature-scaled"):
        await engine.score(list(range(5, 25)), 3, temperature=0.7)
