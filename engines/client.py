"""`SGLangEngine`: the SGLang HTTP protocol over one `httpx.AsyncClient` (trio-compatible).

Contract:
- `async with SGLangEngine(url) as engine:` owns one connection pool; every call is one HTTP
  request (plus bounded retries), so the object is safe to share between many trio tasks.
- Retries happen only on connection failures (refused, reset, dropped before an answer) and on
  HTTP 503, at most `max_retries` times with exponential backoff and a warning log line; after
  that `EngineUnavailableError`. A timeout raises `EngineTimeoutError` at once (the request may
  still be running on the server, so it is never silently repeated). Any other HTTP error
  raises `EngineError` at once, carrying the status and the server's body.
- Works against the local engine and SGLang >= 0.5.6 (`MIN_SGLANG_VERSION`: pause modes and
  `weight_version` appear there); `check_server()` reads `/server_info` and refuses older ones.
  Info routes are the 0.5.23 names (`/model_info`, `/server_info`) with a fallback to the
  deprecated `get_` forms on a 404.
- Control routes (pause, continue, update, flush, abort) carry `admin_api_key` if given; they
  live in `client_control.py` (`ControlRoutesMixin`), generation and scoring here.
- Weight paths are sent absolute (SGLang resolves relative ones in its own cwd);
  `no_stop_trim: true` unless the caller sets it, so `text` decodes all of `output_ids`.
- While this client has the engine paused, `is_healthy()` asks `/model_info`: SGLang's
  `/health_generate` waits behind the pause and answers 503 after 20 s. It does too from a
  memory resume until weights are loaded, and says False while the memory is released
  (colocated mode: client_control.py).
- Every `/generate` (and `score`) carries `extra_key = self.kv_namespace`, SGLang's prefix-cache
  namespace, and every `pause()` moves the client to a fresh namespace first. So a request sent
  after a pause never reuses prefix KV computed before it, i.e. by older weights, even when the
  engine keeps its cache (a pause "in_place" refuses the flush). The namespace starts random,
  so a restarted trainer never reuses a previous run's entries either.

Not covered: streaming (`stream: true`) — RL rollouts use whole responses; the router's worker
management API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import trio

from plumbing.errors import EngineError

from .client_control import ControlRoutesMixin
from .client_refit import RefitRoutesMixin
from .http import DEFAULT_TIMEOUTS, EngineHTTP, EngineTimeouts, decode_json
from .lora import ACTIVE, LoraClientMixin, resolve_lora_path
from .types import (
    EngineTimeoutError,
    EngineUnavailableError,
    GenerateResult,
    ScoreResult,
    generate_body,
    parse_generate_response,
)


class SGLangEngine(ControlRoutesMixin, RefitRoutesMixin, LoraClientMixin):
    """An SGLang (or local engine) server at `url`. See the module docstring for guarantees."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeouts: EngineTimeouts = DEFAULT_TIMEOUTS,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_connections: int = 1024,
        max_keepalive_connections: int = 20,
        transport: httpx.AsyncBaseTransport | None = None,
        retry_generate: bool = True,
        pause_lease_s: float | None = 60.0,
    ) -> None:
        self._http = EngineHTTP(
            url.rstrip("/"),
            api_key=api_key,
            admin_api_key=admin_api_key,
            timeouts=timeouts,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
            max_connections=max_connections,
            max_keepalive_connections=max_keepalive_connections,
            transport=transport,
        )
        self.timeouts = timeouts
        self._url = self._http.url
        # False under an EnginePool: a retry on this URL may reach a restarted server still on
        # its initial weights; the pool retries elsewhere, or here once it has the weights.
        self._generate_retries = None if retry_generate else 0
        self.paused = False  # this client paused the engine and has not resumed it yet
        self.resume_wanted = False  # a resume was asked and has not got through yet
        # another process paused it (`mark_paused_elsewhere`), and how many times it has
        self.paused_elsewhere, self.pauses_elsewhere = False, 0
        # colocated mode: "released" once this client released the engine's memory, "resumed"
        # from its resume until weights are loaded (the local engine serves nothing meanwhile)
        self.resting: str | None = None
        # each pause carries this lease (engines/pause_renewal.py); None: SGLang's plain pause
        self.pause_lease_s: float | None = pause_lease_s
        self._lease_lock = trio.Lock()  # a renewal never reaches the server after the resume
        # (path, version) the last weight sync gave this engine (path None: only adapters were
        # synced); EnginePool checks it
        self.expected_weights: tuple[str | None, str] | None = None
        # LoRA (engines/lora.py): the adapter generation uses unless a call names another, the
        # (name, path) the last LoRA sync gave it, and the adapters this client loaded, oldest first
        self.active_lora: str | None = None
        self.expected_lora: tuple[str, str] | None = None
        self.lora_loaded: list[str] = []
        self._info_paths: dict[str, str] = {}  # "/model_info" -> the form this server answers
        self._kv_id, self._pauses = uuid.uuid4().hex[:12], 0
        self.kv_namespace = f"rollouts-{self._kv_id}-0"  # `extra_key` of every /generate
        # aborts sent while this client had the engine paused: SGLang loses those that target
        # requests held behind the pause, so `resume()` sends them again ("" = abort_all)
        self._aborts_in_pause: list[str] = []

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
        lora_path: str | None = ACTIVE,
    ) -> GenerateResult:
        """Generate one sample from token ids.

        Args:
            input_ids: the prompt as token ids.
            sampling_params: SGLang sampling params (`max_new_tokens`, `temperature`, `stop`,
                ...); `n` must be 1 (use `generate_batch`).
            rid: request id, usable with `abort(rid)`.
            return_logprob, top_logprobs_num, logprob_start_len: as in SGLang.
            lora_path: adapter name; default `self.active_lora`; None = the base model.

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
        body = generate_body(list(input_ids), params, rid, return_logprob, top_logprobs_num,
                             logprob_start_len, resolve_lora_path(self, lora_path))  # fmt: skip
        body["extra_key"] = self.kv_namespace
        started = time.perf_counter()
        response = await self._post_generate(body)
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
        lora_path: str | Sequence[str | None] | None = ACTIVE,
    ) -> list[GenerateResult]:
        """One batched `/generate` call: B prompts (× n samples each), prompt-major order.
        `lora_path`: one adapter name for all, or one per prompt (None = base)."""
        prompts = [list(p) for p in batch_input_ids]
        params: Any = (
            dict(sampling_params or {})
            if isinstance(sampling_params, Mapping | None)
            else [dict(p) for p in sampling_params]
        )
        rid_list = list(rids) if rids else None
        body = generate_body(prompts, params, rid_list, return_logprob, top_logprobs_num,
                             logprob_start_len, resolve_lora_path(self, lora_path))  # fmt: skip
        body["extra_key"] = self.kv_namespace
        started = time.perf_counter()
        response = await self._post_generate(body)
        objs = decode_json(response, "POST /generate", self._url)
        if not isinstance(objs, list):
            raise EngineError("POST /generate: expected a JSON list for a batch", url=self._url,
                              body=response.text)  # fmt: skip
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

    async def _post_generate(self, body: dict[str, Any]) -> httpx.Response:
        timeout, retries = self.timeouts.generate_s, self._generate_retries
        return await self._http.request("POST", "/generate", body=body, timeout=timeout,
                                        retries=retries)  # fmt: skip

    def _parse(self, response: httpx.Response, started: float, prompt_len: int) -> GenerateResult:
        latency = time.perf_counter() - started
        obj = decode_json(response, "POST /generate", self._url)
        try:
            return parse_generate_response(obj, latency_s=latency, prompt_len=prompt_len)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise EngineError(
                f"POST /generate: malformed answer ({exc})", url=self._url, body=response.text
            ) from exc

    async def score(
        self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0,
        lora_path: str | None = ACTIVE,
    ) -> ScoreResult:  # fmt: skip
        """Logprobs of `input_ids[start:]` given their prefixes (prefill only, `max_new_tokens: 0`).

        `start` must be in [1, len(input_ids)); position 0 has no logprob. `lora_path` as in
        `generate` (None scores with the base model).
        """
        ids = list(input_ids)
        if temperature != 1.0:  # SGLang 0.5.23 returns input logprobs of the raw logits
            raise ValueError(
                f"score(temperature={temperature}): SGLang's input logprobs are not "
                "temperature-scaled; only temperature 1.0 can be scored"
            )
        if not 1 <= start < len(ids):
            raise ValueError(f"start must be in [1, {len(ids)}), got {start}")
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": start - 1,  # entry 0 (position start-1) is always null
            "extra_key": self.kv_namespace,
        }
        lora = resolve_lora_path(self, lora_path)
        if lora is not None:
            body["lora_path"] = lora
        started = time.perf_counter()
        response = await self._post_generate(body)
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


async def probe_engines(urls: Sequence[str], *, api_key: str | None = None,
                        timeout_s: float = 10.0, flag: str = "--engine-url") -> None:  # fmt: skip
    """Ask each server for `/server_info` once, without retries, before any other set-up.

    A run against a URL where nothing listens then fails in seconds, with one message, instead
    of after loading the model and a round of retries.

    Raises:
        EngineUnavailableError: some URL did not answer (each failing URL and why).
        EngineError: a server answered but is not usable (error status, SGLang too old).
    """
    timeouts = EngineTimeouts(connect_s=timeout_s, control_s=timeout_s, health_s=timeout_s)
    dead: list[str] = []
    for url in urls:
        async with SGLangEngine(url, api_key=api_key, timeouts=timeouts, max_retries=0) as engine:
            try:
                await engine.check_server()
            except (EngineUnavailableError, EngineTimeoutError) as err:
                dead.append(str(err))
    if dead:
        raise EngineUnavailableError(
            f"no engine answers at {flag} ({'; '.join(dead)}): start one "
            "(`rollouts serve --model-path DIR`) or fix the URL"
        )
