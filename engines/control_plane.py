"""`GatewayControl`: weight syncs through smg's RL control plane when the workers are out of reach.

smg (PyPI `smg`, the gateway formerly `sglang-router`) >= 1.11, launched with `--enable-rl`,
mounts `/v1/rl/*` (read from `smg/rl.py` in the 1.13.0 wheel):
- `GET /v1/rl/workers` → `{"workers": [{"id", "url", "base_url", "engine", "engine_version",
  "weight_version", "dp_ranks", "control_url", "labels", ...}]}`;
- `{METHOD} /v1/rl/engine/{path}?selector=...` sends `{METHOD} {worker}/{path}` with the same
  body to every worker the label selector (`key=value`, `!=`, `in (...)`, comma = and) matches;
  200 or 207 with `{"results": {worker_id: {"url", "status", "latency_ms", "body"}},
  "failed": [{"worker_id", "url", "status", "error", "message"}], "total", "succeeded"}`.
  A bodyless control call must still carry `{}` (SGLang 400s a bodyless pause/continue).

`GatewayControl` is one engine as far as `sync_weights_to_engines` / `pause_engines` are
concerned (pause, flush_cache, update_weights_from_disk, model_info, resume, abort): each call
is one fan-out, and any failed worker makes it raise `EngineError` naming that worker, its URL
and its message, so a sync fails through the same path as a direct one. `model_info` reads
every worker's `weight_version` from the fan-out's report and refuses a fleet that disagrees.

`choose_control_plane` decides between direct calls and the gateway: `auto` probes each
worker's `GET /model_info` with a short deadline (`/health` is open even on servers with an API
key, so it would not tell whether control calls can reach them) and picks the gateway when any
worker does not answer 200.

`url@rank` (smg lists each data-parallel rank of one server as `url@rank`; assumed from the
issue text, the wheel only shows the `dp_ranks` worker field) is one control target: the rank is
dropped and URLs deduplicated (`control_targets`).

Assumptions not confirmed from the wheel (a compiled binary): a worker that answers >= 400 is
reported in `failed` with `error: "upstream_error"` (an unreachable one `upstream_unreachable`);
this client also treats a `results` entry with status >= 400 as a failure.

Not covered: a partial fleet (a worker down during a sync fails it, where the direct path skips
it); LoRA syncs through the gateway; giving a restarted worker the current weights (the direct
path's `EnginePool` does that).
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx
import trio

from plumbing.errors import EngineError

from .client import SGLangEngine
from .types import EngineUnavailableError, ModelInfo, PauseMode

logger = logging.getLogger(__name__)

ControlPlane = Literal["auto", "direct", "gateway"]
_RANK = re.compile(r"^(?P<url>.+://.+)@(?P<rank>\d+)$")


def parse_worker_url(entry: str) -> tuple[str, int | None]:
    """`"http://h:1@2"` → `("http://h:1", 2)`; a plain URL → `(url, None)`."""
    match = _RANK.match(entry.strip())
    if match is None:
        return entry.strip().rstrip("/"), None
    return match["url"].rstrip("/"), int(match["rank"])


def control_targets(entries: Sequence[str]) -> list[str]:
    """One URL per server, in first-seen order: control calls go to a server once, not per rank."""
    return list(dict.fromkeys(parse_worker_url(e)[0] for e in entries))


async def worker_reachable(url: str, *, api_key: str | None = None, timeout_s: float = 2.0) -> bool:
    """True when `GET {url}/model_info` answers 200 within `timeout_s` (see the module doc)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            response = await http.get(url + "/model_info", headers=headers)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def choose_control_plane(mode: ControlPlane, worker_urls: Sequence[str], *,
                               api_key: str | None = None, timeout_s: float = 2.0
                               ) -> Literal["direct", "gateway"]:  # fmt: skip
    """`direct` or `gateway`; `auto` = direct when every worker answers, else gateway."""
    if mode != "auto":
        return mode
    reachable: dict[str, bool] = {}

    async def probe(url: str) -> None:
        reachable[url] = await worker_reachable(url, api_key=api_key, timeout_s=timeout_s)

    async with trio.open_nursery() as nursery:
        for url in worker_urls:
            nursery.start_soon(probe, url)
    unreachable = [u for u, ok in reachable.items() if not ok]
    if worker_urls and not unreachable:
        return "direct"
    logger.info("workers not reachable from here (%s): weight syncs go through the gateway's "
                "/v1/rl control plane", ", ".join(unreachable) or "none listed")  # fmt: skip
    return "gateway"


class GatewayControl:
    """Every worker behind the gateway, driven through `/v1/rl/*` (see the module docstring)."""

    def __init__(self, gateway: SGLangEngine, *, selector: str = "engine=sglang") -> None:
        self.gateway = gateway  # the client generation goes through; its kv_namespace is renewed
        self.selector = selector
        self.paused = False
        self.expected_weights: tuple[str | None, str] | None = None
        self.active_lora: str | None = None
        self.lora_loaded: list[str] = []
        self._pauses = 0

    @property
    def url(self) -> str:
        return self.gateway.url

    def __repr__(self) -> str:
        return f"GatewayControl({self.url!r}, selector={self.selector!r})"

    async def workers(self) -> list[dict[str, Any]]:
        """`GET /v1/rl/workers`: the gateway's worker records."""
        listing = await self.gateway._http.json("GET", "/v1/rl/workers")
        rows = listing.get("workers") if isinstance(listing, Mapping) else None
        if not isinstance(rows, list):
            raise EngineError("GET /v1/rl/workers: no 'workers' list (is smg run with "
                              "--enable-rl?)", url=self.url, body=str(listing))  # fmt: skip
        return [dict(r) for r in rows]

    async def fanout(self, path: str, body: Any = None, *, method: str = "POST",
                     timeout: float | None = None) -> dict[str, tuple[str, Any]]:  # fmt: skip
        """One fan-out; {worker_id: (worker url, the worker's body)} when every worker succeeded.

        Raises:
            EngineError: the gateway refused, or some worker failed (each is named with its URL,
                status and message; `status` is theirs when they all agree, so a caller's retry
                on 400 still works); `EngineUnavailableError` when every failed worker was
                unreachable.
        """
        query = urllib.parse.urlencode({"selector": self.selector})
        route = f"/v1/rl/engine/{path}?{query}"
        report = await self.gateway._http.json(method, route, body=body, timeout=timeout,
                                               retries=0)  # fmt: skip
        if not isinstance(report, Mapping) or "results" not in report:
            raise EngineError(f"{method} {route}: not a fan-out report", url=self.url,
                              body=str(report))  # fmt: skip
        results = report.get("results") or {}
        failed = [dict(f) for f in report.get("failed") or []]
        for wid, row in results.items():
            if int(row.get("status", 0)) >= 400:
                failed.append({"worker_id": wid, "url": row.get("url"), "status": row["status"],
                               "error": "upstream_error", "message": str(row.get("body"))})  # fmt: skip
        if failed:
            lines = [f"{f.get('worker_id')} at {f.get('url')}: {f.get('error')} "
                     f"(HTTP {f.get('status')}): {f.get('message')}" for f in failed]  # fmt: skip
            statuses = {f.get("status") for f in failed}
            kind = (EngineUnavailableError
                    if all(f.get("error") == "upstream_unreachable" for f in failed)
                    else EngineError)  # fmt: skip
            raise kind(
                f"{path} through the gateway's control plane failed on {len(failed)} of "
                f"{report.get('total', len(results))} worker(s): " + "; ".join(lines),
                url=self.url,
                status=statuses.pop() if len(statuses) == 1 else None,
            )
        return {wid: (str(row.get("url")), row.get("body")) for wid, row in results.items()}

    async def pause(self, mode: PauseMode = "abort") -> None:
        self.paused = True  # before the call: it may reach some workers even if it fails
        self._pauses += 1
        # requests sent from now on must not reuse KV cached before the pause (weight_sync doc)
        self.gateway.kv_namespace = f"{self.gateway.kv_namespace.split('/')[0]}/rl{self._pauses}"
        await self.fanout("pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.fanout("continue_generation", {})
        self.paused = False

    async def flush_cache(self) -> None:
        await self.fanout("flush_cache", {})

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None, *,
                                       abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> str:  # fmt: skip
        body: dict[str, Any] = {"model_path": path, "abort_all_requests": abort_all_requests,
                                "flush_cache": flush_cache}  # fmt: skip
        if weight_version is not None:
            body["weight_version"] = weight_version
        results = await self.fanout("update_weights_from_disk", body,
                                    timeout=self.gateway.timeouts.weight_update_s)  # fmt: skip
        refused = [f"{wid} at {url}: {b.get('message')}" for wid, (url, b) in results.items()
                   if isinstance(b, Mapping) and b.get("success") is False]  # fmt: skip
        if refused:
            raise EngineError(
                "update_weights_from_disk failed: " + "; ".join(refused), url=self.url
            )
        return "; ".join(str(b.get("message", "")) for _, b in results.values()
                         if isinstance(b, Mapping))  # fmt: skip

    async def model_info(self) -> ModelInfo:
        """Every worker's `/model_info`, from one fan-out; raises when their versions differ."""
        results = await self.fanout("model_info", method="GET")
        versions = {wid: (url, (b or {}).get("weight_version")) for wid, (url, b) in
                    results.items()}  # fmt: skip
        distinct = {str(v) if v is not None else None for _, v in versions.values()}
        if len(distinct) != 1:
            each = ", ".join(f"{wid} at {url}: {v!r}" for wid, (url, v) in versions.items())
            raise EngineError(f"the workers report different weight_versions: {each}",
                              url=self.url)  # fmt: skip
        first = next(iter(results.values()))[1] or {}
        return ModelInfo(model_path=str(first.get("model_path", "")),
                         weight_version=distinct.pop(), raw=dict(first))  # fmt: skip

    async def abort(self, rid: str) -> None:
        await self.fanout("abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        await self.fanout("abort_request", {"abort_all": True})
