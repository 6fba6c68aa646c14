"""`RouterEngine`: generation through sgl-model-gateway (sglang-router), control to each worker.

The gateway forwards `/generate` to one worker chosen by its policy, and takes one string `rid`
per request: a batch or a list of rids is refused. It has no `/pause_generation`,
`/update_weights_from_disk` or `/abort_request` (sglang_protocol.md §6). So:
- `generate` goes to the gateway with its own `rid`; `generate_batch` sends one request per
  item, concurrently, each with its own rid (`n` must be 1);
- `abort(rid)` and `abort_all()` go to every worker (the driver does not know which worker got
  a request; rids are unique, so aborting one elsewhere is a no-op);
- health and loads go to the gateway (`/health_generate`, `/get_loads`); weight syncs use
  `workers` (plain `SGLangEngine`s), given or read from the gateway's `GET /workers` (legacy
  `GET /list_workers`);
- an answer from other weights than the last sync gave the workers (a worker restarted on its
  initial weights; those of the sync before count while a sync lands during the request) is
  re-sent through the gateway, at most `max_stale_retries` times, then raised as
  `StaleWeightsError`; an `EnginePool` over the workers (the recipe opens one) gives such a
  worker the current weights.

- `server_info()` is the gateway's `/server_info`; smg's may lack `version`, then one
  worker's is used (directly, or through the RL control plane's fan-out).

`workers` may also be one `GatewayControl` (engines/control_plane.py): smg's `/v1/rl/*` control
plane, for deployments where only the gateway is reachable; aborts and syncs then fan out
through the gateway.

Not covered: registering workers with the gateway; prefill/decode disaggregation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import trio

from plumbing.errors import EngineError

from .client import SGLangEngine
from .control_plane import GatewayControl
from .lora import ACTIVE
from .pool import StaleWeightsError
from .types import GenerateResult, ModelInfo, ScoreResult, check_version


class RouterEngine:
    """See the module docstring. `async with RouterEngine(url, workers) as router:`."""

    def __init__(self, gateway: SGLangEngine, workers: Sequence[SGLangEngine] = (), *,
                 max_stale_retries: int = 2) -> None:  # fmt: skip
        self.gateway = gateway
        self.workers = list(workers)
        self.max_stale_retries = max_stale_retries

    @property
    def url(self) -> str:
        return self.gateway.url

    def __repr__(self) -> str:
        return f"RouterEngine({self.url!r}, workers={[w.url for w in self.workers]!r})"

    async def __aenter__(self) -> RouterEngine:
        await self.gateway.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.gateway.__aexit__(*exc_info)

    async def list_workers(self) -> list[str]:
        """Worker URLs from the gateway: `GET /workers`, or the legacy `GET /list_workers`."""
        http = self.gateway._http
        try:
            listing = await http.json("GET", "/workers")
            rows = listing.get("workers") if isinstance(listing, Mapping) else None
            if not isinstance(rows, list):
                raise EngineError(
                    "GET /workers: no 'workers' list", url=self.url, body=str(listing)
                )
            return [str(row["url"]) for row in rows]
        except EngineError as exc:
            if exc.status != 404:
                raise
        listing = await http.json("GET", "/list_workers")
        return [str(u) for u in (listing.get("urls") or [])]

    # ----- generation, through the gateway ----------------------------------------------------

    @property
    def active_lora(self) -> str | None:
        """The adapter the last LoRA sync made active on the workers (the gateway's own
        `active_lora` when no workers are known); generation sends it unless told otherwise."""
        if not self.workers:
            return self.gateway.active_lora
        names = {w.active_lora for w in self.workers}
        if len(names) == 1:
            return names.pop()
        # mid-sync: the newest adapter every worker has loaded (the previous one is kept)
        order = self.workers[0].lora_loaded
        common = [n for n in order if all(n in w.lora_loaded for w in self.workers)]
        return common[-1] if common else None

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None,
                       **kwargs: Any) -> GenerateResult:  # fmt: skip
        if "lora_path" not in kwargs:
            kwargs["lora_path"] = self.active_lora
        for _ in range(self.max_stale_retries + 1):
            sent_to = self._expected_version()  # right too: a push may land before the check
            result = await self.gateway.generate(input_ids, sampling_params, **kwargs)
            expected = self._expected_version()
            right = {v for v in (expected, sent_to) if v is not None}
            if result.aborted or expected is None or result.weight_version in right:
                return result
        raise StaleWeightsError(
            f"{self.max_stale_retries + 1} answers through the gateway came from weight_version "
            f"{result.weight_version!r}, the workers were given {expected!r}: a worker restarted",
            url=self.url,
        )

    def _expected_version(self) -> str | None:
        """The version the last sync gave every worker; None if unknown, mixed or in progress."""
        if any(w.paused for w in self.workers):
            return None
        versions = {w.expected_weights[1] if w.expected_weights else None for w in self.workers}
        return versions.pop() if len(versions) == 1 else None

    async def loads(self) -> Any:
        """The gateway's `GET /get_loads` (requests in flight per worker)."""
        return await self.gateway._http.json("GET", "/get_loads")

    async def generate_batch(
        self,
        batch_input_ids: Sequence[Sequence[int]],
        sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        rids: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> list[GenerateResult]:
        """One gateway request per item (the gateway takes one string rid), concurrently."""
        prompts = list(batch_input_ids)
        params = (
            [sampling_params] * len(prompts)
            if sampling_params is None or isinstance(sampling_params, Mapping)
            else list(sampling_params)
        )
        results: list[GenerateResult | None] = [None] * len(prompts)

        lora = kwargs.pop("lora_path", ACTIVE)
        loras = list(lora) if isinstance(lora, list | tuple) else [lora] * len(prompts)

        async def one(i: int) -> None:
            rid = rids[i] if rids else None
            extra = kwargs if loras[i] is ACTIVE else {**kwargs, "lora_path": loras[i]}
            results[i] = await self.generate(prompts[i], params[i], rid=rid, **extra)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return [r for r in results if r is not None]

    async def score(self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0,
                    lora_path: str | None = ACTIVE) -> ScoreResult:  # fmt: skip
        lora = self.active_lora if lora_path is ACTIVE else lora_path
        return await self.gateway.score(input_ids, start, temperature=temperature, lora_path=lora)

    async def model_info(self) -> ModelInfo:
        return await self.gateway.model_info()

    async def server_info(self) -> dict[str, Any]:
        """The gateway's `/server_info`, with a worker's `version` when the gateway's lacks one."""
        info = await self.gateway.server_info()
        if info.get("version") or not self.workers:
            return info
        worker = self.workers[0]
        if isinstance(worker, GatewayControl):
            answers = await worker.fanout("server_info", method="GET")
            url, theirs = next(iter(answers.values()))
        else:
            url, theirs = worker.url, await worker.server_info()
        return {**info, "version": (theirs or {}).get("version"), "version_from": url}

    async def check_server(self) -> str:
        """`SGLangEngine.check_server` for the fleet behind the gateway (see `server_info`)."""
        return check_version(await self.server_info(), self.url)

    async def is_healthy(self) -> bool:
        return await self.gateway.is_healthy()

    async def wait_healthy(self, timeout_s: float = 600.0) -> None:
        await self.gateway.wait_healthy(timeout_s)

    # ----- control, to every worker -----------------------------------------------------------

    async def abort(self, rid: str) -> None:
        await self._each_worker("abort", rid)

    async def abort_all(self) -> None:
        await self._each_worker("abort_all")

    async def _each_worker(self, method: str, *args: Any) -> None:
        if not self.workers:
            raise EngineError(
                f"{method} cannot go through the gateway (it has no such route) and no worker "
                "URLs are known: give them or read them with list_workers()",
                url=self.url,
            )
        failures: list[str] = []

        async def call(worker: SGLangEngine) -> None:
            try:
                await getattr(worker, method)(*args)
            except EngineError as exc:
                failures.append(str(exc))

        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                nursery.start_soon(call, worker)
        if len(failures) == len(self.workers):
            raise EngineError(f"{method} failed on every worker: " + "; ".join(failures))
