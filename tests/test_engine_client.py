"""`SGLangEngine` error handling against fake servers (the external boundary: a real SGLang
server that answers 503/500, hangs, drops connections or speaks an older protocol version).

The fakes are tiny ASGI apps served by hypercorn on loopback, so the client runs its real
HTTP path.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from engines import (
    EngineError,
    EngineTimeoutError,
    EngineTimeouts,
    EngineUnavailableError,
    SGLangEngine,
    find_free_port,
)


@asynccontextmanager
async def fake_server(http_app):
    """Serve `http_app` (HTTP scopes only) on a free loopback port; yield its URL."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await http_app(scope, receive, send)

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)
        yield binds[0]
        nursery.cancel_scope.cancel()


def json_app(responses, hits: list[str]):
    """Answer successive requests with the given (status, body) pairs; record the paths."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        hits.append(scope["path"])
        status, body = responses[min(len(hits), len(responses)) - 1]
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


GOOD = b'{"text": "hi", "output_ids": [5, 6], "meta_info": {"id": "r1", "finish_reason": {"type": "stop", "matched": 6}, "prompt_tokens": 3, "weight_version": "v3", "output_token_logprobs": [[-0.5, 5, null], [-0.25, 6, null]], "completion_tokens": 2, "cached_tokens": 1, "e2e_latency": 0.1}}'
UNAVAILABLE = b'{"object": "error", "message": "Server is starting", "type": "503", "param": null, "code": 503}'


async def test_503_is_retried_with_backoff_and_a_log_line_then_succeeds(caplog):
    hits: list[str] = []
    caplog.set_level(logging.WARNING, logger="engines.http")
    app = json_app([(503, UNAVAILABLE), (503, UNAVAILABLE), (200, GOOD)], hits)
    async with (
        fake_server(app) as url,
        SGLangEngine(url, max_retries=3, retry_backoff_s=0.01) as engine,
    ):
        result = await engine.generate([1, 2, 3], {"max_new_tokens": 2})
    assert len(hits) == 3
    assert result.output_ids == (5, 6) and result.output_logprobs == (-0.5, -0.25)
    assert (result.finish_reason.type, result.finish_reason.matched) == ("stop", 6)
    assert (result.weight_version, result.cached_tokens, result.rid) == ("v3", 1, "r1")
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 2 and "Server is starting" in retries[0].getMessage()


async def test_503_beyond_the_retry_budget_raises_unavailable_with_the_body():
    hits: list[str] = []
    async with (
        fake_server(json_app([(503, UNAVAILABLE)], hits)) as url,
        SGLangEngine(url, max_retries=2, retry_backoff_s=0.01) as engine,
    ):
        with pytest.raises(EngineUnavailableError) as info:
            await engine.generate([1], {})
    assert len(hits) == 3 and info.value.status == 503 and "Server is starting" in info.value.body


async def test_500_and_400_raise_at_once_with_status_and_server_message():
    for status, body in (
        (
            500,
            b'{"object": "error", "message": "CUDA error: out of memory", "type": "500", "param": null, "code": 500}',
        ),
        (400, b'{"error": {"message": "top_p must be in (0, 1], got 0.0."}}'),
    ):
        hits: list[str] = []
        async with (
            fake_server(json_app([(status, body)], hits)) as url,
            SGLangEngine(url, max_retries=3) as engine,
        ):
            with pytest.raises(EngineError) as info:
                await engine.generate([1], {})
        assert len(hits) == 1 and info.value.status == status and info.value.url == url
        message = body.decode().split('"message": "')[1].split('"')[0]
        assert message in str(info.value) and info.value.body == body.decode()


async def test_a_hanging_server_times_out_without_retrying():
    hits: list[str] = []

    async def hang(scope, receive, send):
        if scope["type"] == "http":
            hits.append(scope["path"])
            await trio.sleep_forever()

    timeouts = EngineTimeouts(generate_s=0.2)
    async with (
        fake_server(hang) as url,
        SGLangEngine(url, timeouts=timeouts, max_retries=3) as engine,
    ):
        with pytest.raises(EngineTimeoutError) as info:
            await engine.generate([1], {})
    assert len(hits) == 1 and isinstance(info.value, TimeoutError)


async def test_connection_refused_and_dropped_connections_are_retried_then_unavailable():
    port = find_free_port()
    async with SGLangEngine(
        f"http://127.0.0.1:{port}", max_retries=2, retry_backoff_s=0.01
    ) as engine:
        with pytest.raises(EngineUnavailableError) as info:
            await engine.model_info()
    assert info.value.status is None and "ConnectError" in str(info.value)

    accepted: list[int] = []

    async def drop(stream: trio.SocketStream) -> None:  # read the request, close without answering
        accepted.append(1)
        await stream.receive_some(65536)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, drop, 0)
        dropped_port = listeners[0].socket.getsockname()[1]
        async with SGLangEngine(
            f"http://127.0.0.1:{dropped_port}", max_retries=2, retry_backoff_s=0.01
        ) as engine:
            with pytest.raises(EngineUnavailableError):
                await engine.generate([1], {})
        nursery.cancel_scope.cancel()
    assert len(accepted) == 3


async def test_older_and_newer_response_shapes_are_accepted():
    old = b'{"text": "hi", "meta_info": {"id": "a", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "output_token_logprobs": [[-1.0, 7], [-2.0, 8]], "completion_tokens": 2}}'
    newest = GOOD.replace(
        b'"e2e_latency": 0.1',
        b'"e2e_latency": 0.1, "weight_versions": [{"version": "v2", "start": 0, "end": 1}, {"version": "v3", "start": 1, "end": 2}], "spec_verify_ct": 0, "future_key": {"x": 1}',
    )
    hits: list[str] = []
    async with (
        fake_server(json_app([(200, old), (200, newest)], hits)) as url,
        SGLangEngine(url) as engine,
    ):
        older = await engine.generate([1, 2, 3], {"max_new_tokens": 2})
        newer = await engine.generate([1, 2, 3], {"max_new_tokens": 2})
    # no output_ids (SGLang <= 0.4.6): read from the logprob triples; missing optional keys default
    assert older.output_ids == (7, 8) and older.output_logprobs == (-1.0, -2.0)
    assert older.weight_version is None and older.cached_tokens == 0
    assert [(s.version, s.start, s.end) for s in newer.weight_versions] == [
        ("v2", 0, 1),
        ("v3", 1, 2),
    ]


async def test_client_refuses_to_run_outside_its_context():
    engine = SGLangEngine("http://127.0.0.1:1")
    with pytest.raises(RuntimeError, match="async with"):
        await engine.model_info()
