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

import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import trio

from rollouts.errors import EngineError

from .http import DEFAULT_TIMEOUTS, EngineHTTP, EngineTimeouts
from .types import (
    EngineUnavailableError,
    GenerateResult,
    ModelInfo,
    PauseMode,
    ScoreResult,
    parse_generate_response,
)


class SGLangEngine:
    """An SGLang (or local engine) server at `url`. See the module docstring for guarantees."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeouts: EngineTimeouts = DEFAULT_TIMEOUTS,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_connections: int = 1024,
        max_keepalive_connections: int = 20,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = EngineHTTP(
            url.rstrip("/"),
            api_key=api_key,
            timeouts=timeouts,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
            max_connections=max_connections,
            max_keepalive_connections=max_keepalive_connections,
            transport=transport,
        )
        self.timeouts = timeouts
        self._url = self._http.url

    @property
    def url(self) -> str:
        return self._url

    def __repr__(self) -> str:
        return f"SGLangEngine({self._url!r})"

    async def __aenter__(self) -> SGLangEngine:
        self._http.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.close()

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
        response = await self._http.request(
            "POST", "/generate", body=body, timeout=self.timeouts.generate_s
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
        response = await self._http.request(
            "POST", "/generate", body=body, timeout=self.timeouts.generate_s
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
        response = await self._http.request(
            "POST", "/generate", body=body, timeout=self.timeouts.generate_s
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
        result = await self._http.json(
            "POST", "/update_weights_from_disk", body=body, timeout=self.timeouts.weight_update_s
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
        await self._http.json(
            "POST",
            "/update_weight_version",
            body={"new_version": new_version, "abort_all_requests": abort_all_requests},
        )

    async def pause(self, mode: PauseMode = "abort") -> None:
        """`/pause_generation`: new requests wait until `resume()`; see SGLang for the modes."""
        await self._http.json("POST", "/pause_generation", body={"mode": mode})

    async def resume(self) -> None:
        await self._http.json("POST", "/continue_generation", body={})

    async def flush_cache(self) -> None:
        await self._http.request("POST", "/flush_cache", timeout=self.timeouts.control_s)

    async def abort(self, rid: str) -> None:
        """Abort one request; it returns with `finish_reason.type == "abort"`. Unknown rids are ignored."""
        await self._http.request(
            "POST", "/abort_request", body={"rid": rid}, timeout=self.timeouts.control_s
        )

    async def abort_all(self) -> None:
        await self._http.request(
            "POST", "/abort_request", body={"abort_all": True}, timeout=self.timeouts.control_s
        )

    async def model_info(self) -> ModelInfo:
        info = await self._http.json("GET", "/get_model_info")
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
        return dict(await self._http.json("GET", "/get_server_info"))

    async def is_healthy(self) -> bool:
        """One `/health_generate` probe, no retries: True on 200."""
        try:
            await self._http.request(
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
                await self._http.request(
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
