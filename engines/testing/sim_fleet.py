"""A simulated fleet of SGLang engines: `/generate` answers at a set token rate, with no model.

Why: the controller (one trio process) must be measured against 1-64 engines as fast as H100
servers (issue 31), on a machine that has neither. Each simulated engine answers SGLang's
`/generate` in the local engine's exact shape (`text`, `output_ids`, `meta_info` with `id`,
`finish_reason`, `prompt_tokens`, `weight_version`, `input_token_logprobs`,
`output_token_logprobs`, `completion_tokens`, `weight_versions`, ...) and the routes a weight
sync uses (`/pause_generation`, `/continue_generation`, `/update_weights_from_disk`,
`/flush_cache`, `/abort_request`, `/model_info`, `/server_info`, `/health*`).

Contract:
- Rate: each engine decodes at most `tokens_per_s` tokens in aggregate (SGLang's decode
  throughput at its running batch): a request for k samples × T tokens reserves k·T/rate
  seconds of the engine's time behind the requests before it, and is answered when that
  reservation ends, never sooner than `latency_s` after it arrived. Every sample is `max_new_tokens`
  long and ends on a matched stop token (finish reason "stop", status completed), so a step's
  token count is exact.
- Answers are pre-built bytes per response length (8 token/logprob variants, picked per rid, so
  rewards can differ inside a group); only `id`, `weight_version` and the prompt length are
  spliced in, so one process serves 64 engines at tens of thousands of samples per second.
- Pause (any mode) holds new and waiting requests until `/continue_generation`; mode "abort"
  (and `/abort_request`) answers the held requests at once with finish reason "abort" and no
  tokens. `/update_weights_from_disk` takes `sync_s` seconds, then reports the new
  `weight_version`; it never reads the path.
- Binds 127.0.0.1 only. `python -m engines.testing.sim_fleet --engines N ...` serves a fleet in
  its own process (so its CPU is not the controller's) and prints one JSON line of URLs;
  `open_sim_fleet` runs that process under trio.

Not covered: `text` prompts (no tokenizer: 400), streaming, top logprobs, LoRA routes, stop
strings, prefix caching, the OpenAI routes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import trio

from .sim_http import serve_bare_http

SIM_VERSION = "0.5.23"  # what /server_info reports: the SGLang release the protocol follows
VARIANTS = 8
_JSON = "application/json"


@dataclass(frozen=True)
class SimEngineConfig:
    """How fast one simulated engine is."""

    tokens_per_s: float = 20_000.0  # aggregate decode rate of one engine
    latency_s: float = 0.0  # floor of every /generate (queueing, prefill, network)
    sync_s: float = 0.0  # time one /update_weights_from_disk takes
    max_new_tokens: int = 128  # SGLang's default when the request names none


@dataclass
class SimEngineStats:
    requests: int = 0
    samples: int = 0
    tokens: int = 0
    aborted: int = 0
    weight_updates: int = 0


@dataclass
class _Waiting:
    rids: list[str]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    aborted: bool = False


class _Answers:
    """Pre-built JSON fragments per (response length, variant): the costly part of an answer."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int], tuple[bytes, bytes, bytes]] = {}

    def parts(self, n_tokens: int, variant: int) -> tuple[bytes, bytes, bytes]:
        """(`"output_ids":[...]`, `"output_token_logprobs":[...]`, `"text":...`) as bytes."""
        key = (n_tokens, variant)
        if key not in self._cache:
            rng = random.Random(n_tokens * VARIANTS + variant)
            ids = [rng.randrange(3, 32_000) for _ in range(n_tokens)]
            lps = [round(-rng.expovariate(2.0), 6) for _ in range(n_tokens)]
            self._cache[key] = (
                b'"output_ids":' + json.dumps(ids).encode(),
                b'"output_token_logprobs":'
                + json.dumps([[lp, t, None] for lp, t in zip(lps, ids, strict=True)]).encode(),
                b'"text":' + json.dumps(f" sim answer {variant}").encode(),
            )
        return self._cache[key]


class SimEngine:
    """One simulated engine's state and routes (see the module docstring)."""

    def __init__(self, config: SimEngineConfig, answers: _Answers, name: str) -> None:
        self.config = config
        self.name = name
        self.weight_version = "default"
        self.stats = SimEngineStats()
        self._answers = answers
        self._busy_until = 0.0
        self._paused = False
        self._resumed = trio.Event()
        self._waiting: list[_Waiting] = []

    async def handle(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        if path == "/generate" and method in ("POST", "PUT"):
            return await self._generate(body)
        if path in ("/health", "/health_generate", "/liveness", "/readiness"):
            return 200, "text/plain", b""
        if path in ("/model_info", "/get_model_info"):
            return 200, _JSON, json.dumps({
                "model_path": f"sim/{self.name}", "tokenizer_path": f"sim/{self.name}",
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": "sim", "architectures": None,
            }).encode()  # fmt: skip
        if path in ("/server_info", "/get_server_info"):
            return 200, _JSON, json.dumps({
                "model_path": f"sim/{self.name}", "version": SIM_VERSION,
                "weight_version": self.weight_version, "context_length": 1 << 20,
                "internal_states": [{"paused": self._paused,
                                     "num_running_reqs": len(self._waiting)}],
            }).encode()  # fmt: skip
        if method != "POST" and path != "/flush_cache":
            return 404, _JSON, b'{"detail":"Not Found"}'
        request = json.loads(body or b"{}")
        if path == "/pause_generation":
            self._paused, self._resumed = True, trio.Event()
            if request.get("mode", "abort") == "abort":
                self._abort(None)
            return 200, _JSON, b'{"message":"Generation paused successfully.","status":"ok"}'
        if path == "/continue_generation":
            self._paused = False
            self._resumed.set()
            return 200, _JSON, b'{"message":"Generation continued successfully.","status":"ok"}'
        if path == "/abort_request":
            self._abort(None if request.get("abort_all") else request.get("rid"))
            return 200, _JSON, b""
        if path == "/flush_cache":
            return 200, "text/plain; charset=utf-8", b"Cache flushed.\n"
        if path in ("/update_weights_from_disk", "/update_weight_version"):
            await trio.sleep(self.config.sync_s if path == "/update_weights_from_disk" else 0)
            version = request.get("weight_version") or request.get("new_version")
            if version is not None:
                self.weight_version = str(version)
            self.stats.weight_updates += 1
            message = f"Succeeded to update model weights. sim {self.weight_version}"
            return 200, _JSON, json.dumps({"success": True, "message": message,
                                           "num_paused_requests": 0}).encode()  # fmt: skip
        return 404, _JSON, b'{"detail":"Not Found"}'

    def _abort(self, rid: str | None) -> None:
        for waiting in self._waiting:
            if rid is None or rid in waiting.rids:
                waiting.aborted = True
                waiting.scope.cancel()

    async def _generate(self, body: bytes) -> tuple[int, str, bytes]:
        request = json.loads(body)
        prompts = request.get("input_ids")
        if not isinstance(prompts, list) or not prompts:
            message = b"input_ids: a non-empty list is required (the sim engine has no tokenizer)"
            return 400, _JSON, b'{"error":{"message":"%s"}}' % message
        batch = isinstance(prompts[0], list)
        prompts = prompts if batch else [prompts]
        params = request.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        rids = request.get("rid")
        rids = rids if isinstance(rids, list) else [rids or uuid.uuid4().hex] * len(prompts)
        lengths = [int(p.get("max_new_tokens") or self.config.max_new_tokens) for p in params]
        cost = sum(lengths) / self.config.tokens_per_s
        waiting = _Waiting(list(rids))
        self._waiting.append(waiting)
        reserved_at = None
        try:
            with waiting.scope:
                while self._paused:  # held in front of the engine, as SGLang holds them
                    await self._resumed.wait()
                reserved_at = now = trio.current_time()
                start = max(now, self._busy_until)
                self._busy_until = start + cost
                await trio.sleep_until(max(start + cost, now + self.config.latency_s))
                while self._paused:  # finished, but a pause in place holds the answer
                    await self._resumed.wait()
        finally:
            self._waiting.remove(waiting)
        if waiting.aborted and reserved_at is not None:  # give back the time it did not use
            self._busy_until = max(trio.current_time(), self._busy_until - cost)
        with_lp = request.get("return_logprob", False)
        with_lp = with_lp if isinstance(with_lp, list) else [with_lp] * len(prompts)
        records = [
            self._record(rid, prompt, 0 if waiting.aborted else n, bool(lp))
            for rid, prompt, n, lp in zip(rids, prompts, lengths, with_lp, strict=True)
        ]
        self.stats.requests += 1
        self.stats.samples += len(records)
        self.stats.tokens += 0 if waiting.aborted else sum(lengths)
        self.stats.aborted += len(records) if waiting.aborted else 0
        answer = b"[" + b",".join(records) + b"]" if batch else records[0]
        return 200, _JSON, answer

    def _record(self, rid: str, prompt: list[int], n_tokens: int, with_logprob: bool) -> bytes:
        """One `/generate` object, as the local engine's `generate_record` shapes it."""
        ids, lps, text = self._answers.parts(n_tokens, zlib.crc32(rid.encode()) % VARIANTS)
        version = json.dumps(self.weight_version).encode()
        finish = (b'{"type":"abort","message":"Abort before prefill"}' if n_tokens == 0 else
                  b'{"type":"stop","matched":2}')  # fmt: skip
        meta = [b'"id":' + json.dumps(rid).encode(), b'"finish_reason":' + finish,
                b'"prompt_tokens":%d' % len(prompt), b'"weight_version":' + version,
                b'"num_retractions":0']  # fmt: skip
        if with_logprob:
            meta += [b'"input_token_logprobs":[[null,%d,null]]' % prompt[-1], lps,
                     b'"output_token_logprobs_length":%d' % n_tokens]  # fmt: skip
        meta += [b'"reasoning_tokens":0', b'"completion_tokens":%d' % n_tokens,
                 b'"cached_tokens":0', b'"cached_tokens_details":null', b'"dp_rank":null',
                 b'"weight_versions":[{"version":%s,"start":0,"end":%d}]' % (version, n_tokens),
                 b'"e2e_latency":0.0', b'"response_sent_to_client_ts":0.0']  # fmt: skip
        return b"{" + text + b"," + ids + b',"meta_info":{' + b",".join(meta) + b"}}"


async def serve_sim_fleet(n_engines: int, config: SimEngineConfig, *,
                          task_status: trio.TaskStatus[list[SimEngine]] = trio.TASK_STATUS_IGNORED
                          ) -> None:  # fmt: skip
    """Serve `n_engines` simulated engines in this trio run, one loopback port each, until
    cancelled; `task_status.started(engines)` once all are bound (each has `.url`)."""
    answers = _Answers()
    engines = [SimEngine(config, answers, f"engine-{i}") for i in range(n_engines)]
    async with trio.open_nursery() as nursery:
        for engine in engines:
            engine.url = await nursery.start(serve_bare_http, engine.handle)  # type: ignore[attr-defined]
        task_status.started(engines)


@contextlib.asynccontextmanager
async def open_sim_fleet(
    n_engines: int, config: SimEngineConfig = SimEngineConfig(), *, start_timeout_s: float = 60.0
) -> AsyncIterator[tuple[list[str], int]]:
    """Run a fleet in its own process (its CPU is not the caller's); yields (urls, pid)."""
    args = [sys.executable, "-m", "engines.testing.sim_fleet", "--engines", str(n_engines),
            "--tokens-per-s", str(config.tokens_per_s), "--latency-s", str(config.latency_s),
            "--sync-s", str(config.sync_s)]  # fmt: skip
    async with trio.open_nursery() as nursery:
        # cancelling run_process ends the fleet (SIGTERM, then SIGKILL after trio's grace)
        process = await nursery.start(partial(trio.run_process, args, stdout=subprocess.PIPE,
                                              check=False))  # fmt: skip
        try:
            with trio.fail_after(start_timeout_s):  # waits for the fleet's line of URLs
                line = b""
                while not line.endswith(b"\n"):
                    chunk = await process.stdout.receive_some(1 << 20)
                    if not chunk:
                        raise RuntimeError(f"the sim fleet exited before serving: {args}")
                    line += chunk
            yield json.loads(line)["urls"], process.pid
        finally:
            nursery.cancel_scope.cancel()


def main() -> int:
    p = argparse.ArgumentParser(description="Serve a simulated SGLang fleet on 127.0.0.1.")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--tokens-per-s", type=float, default=SimEngineConfig.tokens_per_s)
    p.add_argument("--latency-s", type=float, default=0.0)
    p.add_argument("--sync-s", type=float, default=0.0)
    args = p.parse_args()
    config = SimEngineConfig(args.tokens_per_s, args.latency_s, args.sync_s)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            engines = await nursery.start(serve_sim_fleet, args.engines, config)
            print(json.dumps({"urls": [e.url for e in engines]}), flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
