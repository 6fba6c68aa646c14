"""`SGLangEngine`: the SGLang HTTP protocol over one `httpx.AsyncClient` (trio-compatible).

Contract:
- `async with SGLangEngine(url) as engine:` owns one connection pool; every call is one HTTP
  request (plus bounded retries), so the object is safe to share between many trio tasks.
- Retries happen only on connection failures (refused, reset, dropped before an answer) and on
  HTTP 503, at most `max_retries` times with exponential backoff and a warning log line; after
  that `EngineUnavailableError`. A timeout raises `EngineTimeoutError` at once (the request may
  still be running on the server, so it is never silently repeated). Any other HTTP error
  raises `EngineError` at once, carrying the status and the server's body.
- Works against the local engine and SGLang 0.4.x–0.5.x servers (older/newer response shapes).

Not covered: streaming (`stream: true`) — RL rollouts use whole responses; the router's worker
management API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from rollouts.errors import EngineError

from .types import (
    EngineTimeoutError,
    EngineUnavailableError,
    GenerateResult,
    ModelInfo,
    PauseMode,
    ScoreResult,
    parse_generate_response,
)

logger = logging.getLogger(__name__)

# Failures where the server never produced an answer: safe to retry.
_RETRYABLE = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)


@dataclass(frozen=True)
class EngineTimeouts:
    """Seconds per call kind (None = no limit)."""

    connect_s: float = 10.0
    generate_s: float | None = 3600.0
    control_s: float = 120.0  # pause, abort, flush, info
    weight_update_s: float = 1800.0
    health_s: float = 10.0


def _server_message(response: httpx.Response) -> str:
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
        if error is not None:
            return str(error)
    return response.text.strip()


class SGLangEngine:
    """An SGLang (or local engine) server at `url`. See the module docstring for guarantees."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeouts: EngineTimeouts = EngineTimeouts(),
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_connections: int = 1024,
        max_keepalive_connections: int = 20,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._url = url.rstrip("/")
        self.timeouts = timeouts
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._api_key = api_key
        self._max_connections = max_connections
        self._max_keepalive = max_keepalive_connections
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._timeout_cache: dict[float | None, httpx.Timeout] = {}

    @property
    def url(self) -> str:
        return self._url

    def __repr__(self) -> str:
        return f"SGLangEngine({self._url!r})"

    async def __aenter__(self) -> SGLangEngine:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self._url,
            headers=headers,
            transport=self._transport,
            timeout=httpx.Timeout(self.timeouts.control_s, connect=self.timeouts.connect_s),
            # Keep-alive shorter than SGLang's uvicorn (5 s), so the server never closes a
            # connection the client is about to reuse. Few idle connections: httpcore scans
            # its whole pool for every request, and 64 idle connections made each request cost
            # ~3x the client CPU of 20 (benchmarks/engine_throughput.py).
            limits=httpx.Limits(
                max_connections=self._max_connections,
                max_keepalive_connections=self._max_keepalive,
                keepalive_expiry=4.0,
            ),
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ----- transport ------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        timeout: float | None,
        retries: int | None = None,
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
                    method, path, json=json, timeout=request_timeout
                )
            except _RETRYABLE as exc:
                what = f"{method} {path}"
                failure: EngineError = EngineUnavailableError(
                    f"{what}: cannot reach the engine ({type(exc).__name__}: {exc})", url=self._url
                )
            except httpx.TimeoutException as exc:
                what = f"{method} {path}"
                raise EngineTimeoutError(
                    f"{what}: no answer within {timeout} s ({type(exc).__name__})", url=self._url
                ) from exc
            else:
                if response.status_code < 400:
                    return response
                # The server's own message goes in the text; the raw body stays on `.body`.
                what = f"{method} {path}"
                message = _server_message(response)
                if response.status_code != 503:
                    error = EngineError(
                        f"{what} failed: {message}", url=self._url, status=response.status_code
                    )
                    error.body = response.text
                    raise error
                failure = EngineUnavailableError(
                    f"{what}: engine unavailable: {message}", url=self._url, status=503
                )
                failure.body = response.text
            if attempt == retries:
                raise failure
            delay = self.retry_backoff_s * 2**attempt
            logger.warning("%s; retry %d/%d in %.1f s", failure, attempt + 1, retries, delay)
            await trio.sleep(delay)
        raise AssertionError("unreachable")

    async def _json(
        self, method: str, path: str, *, json: Any = None, timeout: float | None = None
    ) -> Any:
        response = await self._request(
            method, path, json=json, timeout=self.timeouts.control_s if timeout is None else timeout
        )
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(
                f"{method} {path}: answer is not JSON",
                url=self._url,
                status=response.status_code,
                body=response.text,
            ) from exc

    # ----- generation -----------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
        logprob_start_len: int | None = None,
    ) -> GenerateResult:
        """Generate one sample from token ids.

        Args:
            input_ids: the prompt as token ids.
            sampling_params: SGLang sampling params (`max_new_tokens`, `temperature`, `stop`,
                ...); `n` must be 1 (use `generate_batch`).
            rid: request id, usable with `abort(rid)`.
            return_logprob, top_logprobs_num, logprob_start_len: as in SGLang.

        Returns:
            A `GenerateResult`; an aborted request returns normally with
            `finish_reason.type == "abort"`.

        Raises:
            EngineError (400 for invalid params, 500 ...), EngineUnavailableError,
            EngineTimeoutError.
        """
        params = dict(sampling_params or {})
        if params.get("n", 1) != 1:
            raise ValueError("generate() returns one sample; use generate_batch() for n > 1")
        body = self._generate_body(
            list(input_ids), params, rid, return_logprob, top_logprobs_num, logprob_start_len
        )
        started = time.perf_counter()
        response = await self._request(
            "POST", "/generate", json=body, timeout=self.timeouts.generate_s
        )
        return self._parse(response, started, len(body["input_ids"]))

    async def generate_batch(
        self,
        batch_input_ids: Sequence[Sequence[int]],
        sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        rids: Sequence[str] | None = None,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
        logprob_start_len: int | None = None,
    ) -> list[GenerateResult]:
        """One batched `/generate` call: B prompts (× n samples each), prompt-major order."""
        prompts = [list(p) for p in batch_input_ids]
        params: Any = (
            dict(sampling_params or {})
            if isinstance(sampling_params, Mapping | None)
            else [dict(p) for p in sampling_params]
        )
        body = self._generate_body(
            prompts,
            params,
            list(rids) if rids else None,
            return_logprob,
            top_logprobs_num,
            logprob_start_len,
        )
        started = time.perf_counter()
        response = await self._request(
            "POST", "/generate", json=body, timeout=self.timeouts.generate_s
        )
        objs = response.json()
        if not isinstance(objs, list):
            raise EngineError(
                "POST /generate: expected a JSON list for a batch",
                url=self._url,
                body=response.text,
            )
        n = len(objs) // max(1, len(prompts))
        latency = time.perf_counter() - started
        try:
            return [
                parse_generate_response(
                    o, latency_s=latency, prompt_len=len(prompts[i // max(1, n)])
                )
                for i, o in enumerate(objs)
            ]
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise EngineError(
                f"POST /generate: malformed answer ({exc})", url=self._url, body=response.text
            ) from exc

    def _generate_body(
        self, input_ids, params, rid, return_logprob, top_logprobs_num, logprob_start_len
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": params,
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        return body

    def _parse(self, response: httpx.Response, started: float, prompt_len: int) -> GenerateResult:
        latency = time.perf_counter() - started
        try:
            return parse_generate_response(
                response.json(), latency_s=latency, prompt_len=prompt_len
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise EngineError(
                f"POST /generate: malformed answer ({exc})", url=self._url, body=response.text
            ) from exc

    async def score(
        self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0
    ) -> ScoreResult:
        """Logprobs of `input_ids[start:]` given their prefixes (prefill only, `max_new_tokens: 0`).

        `start` must be in [1, len(input_ids)); position 0 has no logprob.
        """
        ids = list(input_ids)
        if not 1 <= start < len(ids):
            raise ValueError(f"start must be in [1, {len(ids)}), got {start}")
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": start - 1,  # entry 0 (position start-1) is always null
        }
        started = time.perf_counter()
        response = await self._request(
            "POST", "/generate", json=body, timeout=self.timeouts.generate_s
        )
        result = self._parse(response, started, len(ids))
        logprobs = result.input_logprobs or ()
        if len(logprobs) != len(ids) - start + 1:
            raise EngineError(
                f"score: expected {len(ids) - start + 1} input logprobs, got {len(logprobs)}",
                url=self._url,
                body=response.text[:2000],
            )
        return ScoreResult(
            logprobs=tuple(float(v) for v in logprobs[1:]),  # type: ignore[arg-type]
            prompt_tokens=result.prompt_tokens,
            weight_version=result.weight_version,
            latency_s=result.latency_s,
        )

    # ----- control --------------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        path: str,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> str:
        """Load new weights from `path` (HF layout). Returns the server's message.

        Raises:
            EngineError: the server refused (it then keeps its old weights); the message is
                the server's.
        """
        body: dict[str, Any] = {
            "model_path": str(path),
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        result = await self._json(
            "POST", "/update_weights_from_disk", json=body, timeout=self.timeouts.weight_update_s
        )
        if isinstance(result, Mapping) and result.get("success") is False:
            raise EngineError(
                f"update_weights_from_disk failed: {result.get('message')}",
                url=self._url,
                body=str(result),
            )
        return str(result.get("message", "")) if isinstance(result, Mapping) else ""

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = True
    ) -> None:
        await self._json(
            "POST",
            "/update_weight_version",
            json={"new_version": new_version, "abort_all_requests": abort_all_requests},
        )

    async def pause(self, mode: PauseMode = "abort") -> None:
        """`/pause_generation`: new requests wait until `resume()`; see SGLang for the modes."""
        await self._json("POST", "/pause_generation", json={"mode": mode})

    async def resume(self) -> None:
        await self._json("POST", "/continue_generation", json={})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache", timeout=self.timeouts.control_s)

    async def abort(self, rid: str) -> None:
        """Abort one request; it returns with `finish_reason.type == "abort"`. Unknown rids are ignored."""
        await self._request(
            "POST", "/abort_request", json={"rid": rid}, timeout=self.timeouts.control_s
        )

    async def abort_all(self) -> None:
        await self._request(
            "POST", "/abort_request", json={"abort_all": True}, timeout=self.timeouts.control_s
        )

    async def model_info(self) -> ModelInfo:
        info = await self._json("GET", "/get_model_info")
        if not isinstance(info, Mapping):
            raise EngineError(
                "GET /get_model_info: expected an object", url=self._url, body=str(info)
            )
        version = info.get("weight_version")
        return ModelInfo(
            model_path=str(info.get("model_path", "")),
            weight_version=None if version is None else str(version),
            raw=dict(info),
        )

    async def server_info(self) -> dict[str, Any]:
        return dict(await self._json("GET", "/get_server_info"))

    async def is_healthy(self) -> bool:
        """One `/health_generate` probe, no retries: True on 200."""
        try:
            await self._request(
                "GET", "/health_generate", timeout=self.timeouts.health_s, retries=0
            )
        except EngineError:
            return False
        return True

    async def wait_healthy(self, timeout_s: float = 600.0, *, poll_interval_s: float = 1.0) -> None:
        """Poll `/health_generate` until it answers 200.

        Raises:
            EngineUnavailableError: not healthy within `timeout_s` (names the last failure).
        """
        deadline = trio.current_time() + timeout_s
        last = "no answer yet"
        while True:
            try:
                await self._request(
                    "GET", "/health_generate", timeout=self.timeouts.health_s, retries=0
                )
                return
            except EngineError as exc:
                last = str(exc)
            if trio.current_time() + poll_interval_s > deadline:
                raise EngineUnavailableError(
                    f"not healthy after {timeout_s} s; last: {last}", url=self._url
                )
            await trio.sleep(poll_interval_s)
