"""HTTP plumbing of the engine client: per-call-kind timeouts, bounded retries, error bodies.

Contract: `EngineHTTP.request` retries only failures where the server produced no answer
(refused, reset, dropped) and HTTP 503, at most `max_retries` times with exponential backoff
and a warning log line, then raises `EngineUnavailableError`; a timeout raises
`EngineTimeoutError` at once (the request may still run on the server, so it is never silently
repeated); any other HTTP error raises `EngineError` at once with the status, the server's
message in the text and the raw body on `.body`. A 2xx that is not JSON raises
`EngineBadAnswerError` (status 502: transient, so a pool fails it over and a rollout retries it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from plumbing.errors import EngineError
from plumbing.gc_pause import gc_paused

from .types import EngineTimeoutError, EngineUnavailableError

logger = logging.getLogger(__name__)

try:  # optional: the same objects, parsed several times faster (see decode_json)
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - depends on the environment
    from json import loads as _loads

# Failures where the server never produced an answer: safe to retry.
_RETRYABLE = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)


@dataclass(frozen=True)
class EngineTimeouts:
    """Seconds per call kind (None = no limit)."""

    connect_s: float = 10.0
    generate_s: float | None = 3600.0
    control_s: float = 120.0  # pause, abort, flush, info
    weight_update_s: float = 1800.0  # the HTTP limit; a sync bounds a load far sooner:
    # `weight_update_floor_s + weight_update_s_per_gb × GB` of the weights it loads
    # (engines/sync_steps.py `update_bound_s`), then counts that engine down
    weight_update_floor_s: float = 30.0
    weight_update_s_per_gb: float = 10.0
    health_s: float = 10.0


DEFAULT_TIMEOUTS = EngineTimeouts()


def server_message(response: httpx.Response) -> str:
    """The human part of an error body: `error.message`, `message`, `error`, or the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
        if body.get("error_message"):  # LoRA load/unload (`LoRAUpdateOutput`)
            return str(body["error_message"])
        if error is not None:
            return str(error)
    return response.text.strip()


class EngineHTTP:
    """One `httpx.AsyncClient` to one server, opened and closed by its owner."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None,
        admin_api_key: str | None = None,
        timeouts: EngineTimeouts,
        max_retries: int,
        retry_backoff_s: float,
        max_connections: int,
        max_keepalive_connections: int,
        transport: httpx.AsyncBaseTransport | None,
    ) -> None:
        self.url = url
        self.timeouts = timeouts
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._api_key = api_key
        # Control routes (SGLang's ADMIN_OPTIONAL level) take the admin key when there is one.
        self._admin_headers = (
            {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else None
        )
        self._max_connections = max_connections
        self._max_keepalive = max_keepalive_connections
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._timeout_cache: dict[float | None, httpx.Timeout] = {}

    def open(self) -> None:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            transport=self._transport,
            timeout=httpx.Timeout(self.timeouts.control_s, connect=self.timeouts.connect_s),
            # Keep-alive shorter than SGLang's uvicorn (5 s), so the server never closes a
            # connection the client is about to reuse. Few idle connections: httpcore scans
            # its whole pool for every request, and 64 idle connections made each request cost
            # ~3x the client CPU of 20 (measured with benchmarks/engine_throughput.py).
            limits=httpx.Limits(
                max_connections=self._max_connections,
                max_keepalive_connections=self._max_keepalive,
                keepalive_expiry=4.0,
            ),
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def wait_ok(self, path: str, timeout_s: float, poll_interval_s: float) -> None:
        """Poll `GET path` until it answers 2xx (an engine's health route while it loads).

        Raises:
            EngineUnavailableError: no 2xx within `timeout_s` (names the last failure).
        """
        deadline = trio.current_time() + timeout_s
        last = "no answer yet"
        while True:
            try:
                await self.request("GET", path, timeout=self.timeouts.health_s, retries=0)
                return
            except EngineError as exc:
                last = str(exc)
            if trio.current_time() + poll_interval_s > deadline:
                raise EngineUnavailableError(f"not healthy after {timeout_s} s; last: {last}",
                                             url=self.url)  # fmt: skip
            await trio.sleep(poll_interval_s)

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        timeout: float | None,
        retries: int | None = None,
        admin: bool = False,
    ) -> httpx.Response:
        if self._client is None:
            raise RuntimeError("use `async with SGLangEngine(url) as engine:` before calling it")
        retries = self.max_retries if retries is None else retries
        request_timeout = self._timeout_cache.get(timeout)
        if request_timeout is None:
            request_timeout = httpx.Timeout(timeout, connect=self.timeouts.connect_s)
            self._timeout_cache[timeout] = request_timeout
        for attempt in range(retries + 1):
            try:
                response = await self._client.request(
                    method,
                    path,
                    json=body,
                    timeout=request_timeout,
                    headers=self._admin_headers if admin else None,
                )
            except _RETRYABLE as exc:
                what = f"{method} {path}"
                failure: EngineError = EngineUnavailableError(
                    f"{what}: cannot reach the engine ({type(exc).__name__}: {exc})", url=self.url
                )
            except httpx.TimeoutException as exc:
                what = f"{method} {path}"
                raise EngineTimeoutError(
                    f"{what}: no answer within {timeout} s ({type(exc).__name__})", url=self.url
                ) from exc
            else:
                if response.status_code < 400:
                    return response
                # The server's own message goes in the text; the raw body stays on `.body`.
                what = f"{method} {path}"
                message = server_message(response)
                if response.status_code != 503:
                    error = EngineError(
                        f"{what} failed: {message}", url=self.url, status=response.status_code
                    )
                    error.body = response.text
                    raise error
                failure = EngineUnavailableError(
                    f"{what}: engine unavailable: {message}", url=self.url, status=503
                )
                failure.body = response.text
            if attempt == retries:
                raise failure
            delay = self.retry_backoff_s * 2**attempt
            logger.warning("%s; retry %d/%d in %.1f s", failure, attempt + 1, retries, delay)
            await trio.sleep(delay)
        raise AssertionError("unreachable")

    async def json(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        timeout: float | None = None,
        admin: bool = False,
        retries: int | None = None,
    ) -> Any:
        response = await self.request(
            method,
            path,
            body=body,
            timeout=self.timeouts.control_s if timeout is None else timeout,
            admin=admin,
            retries=retries,
        )
        return decode_json(response, f"{method} {path}", self.url)


_LARGE_BODY = 256 * 1024  # bytes: a /generate answer of a few thousand tokens and up


def decode_json(response: httpx.Response, what: str, url: str) -> Any:
    """The body as JSON, or an `EngineError` naming the call (a 200 that is not JSON: a proxy's
    page, a truncated body) instead of a bare `JSONDecodeError` that skips error handling.

    Parsed with orjson when it is installed (`pip install orjson`, in the `fast` extra): a
    `/generate` answer is mostly token ids and logprobs, and decoding it was the controller's
    largest CPU cost at cluster scale (issue 31, benchmarks/controller_scale.py)."""
    content = response.content
    try:
        with gc_paused(len(content) >= _LARGE_BODY):  # its objects are acyclic
            return _loads(content)
    except ValueError:  # orjson refuses NaN/Infinity literals, which Python's json writes
        pass
    try:
        return json.loads(response.content)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise EngineBadAnswerError(what, response, exc, url) from exc


class EngineBadAnswerError(EngineError):
    """A 2xx whose body is not JSON: a misrouted load balancer's page, a truncated answer.

    Nothing the request itself got wrong, so it is transient: `status` is 502 (Bad Gateway, an
    invalid answer from upstream), which pools fail over and rollouts retry like any 5xx; the
    text keeps the status the server really sent.
    """

    def __init__(self, what: str, response: httpx.Response, exc: ValueError, url: str) -> None:
        super().__init__(f"{what}: the answer (HTTP {response.status_code}) is not JSON ({exc}); "
                         "retried as a 502 Bad Gateway", url=url, body=response.text[:2000])  # fmt: skip
        self.status = 502
        self.sent_status = response.status_code
