"""A small imitation of sgl-model-gateway (PyPI `sglang-router`) for tests and demos.

It speaks the gateway's request shapes as far as this project uses them (sglang_protocol.md §6):
- `POST /generate` is forwarded to ONE worker (round robin over healthy ones; a worker that
  cannot be reached is skipped, as the gateway retries). The body must be one request: a list
  `rid` or a batch of prompts is refused with 400, since the gateway takes one string `rid`.
- `GET /workers` (`{"workers": [{"id", "url", "is_healthy", ...}], "total": N}`),
  `GET /list_workers` (legacy), `GET /health`, `/health_generate`, `/liveness`, `/readiness`,
  `GET /get_loads`, `POST /flush_cache` (sent to every worker), and the info routes answered by
  a worker.
- smg's RL control plane (`smg --enable-rl`, `engines.control_plane`): `GET /v1/rl/workers`,
  `GET /v1/rl/workers/{id}`, `{METHOD} /v1/rl/workers/{id}/engine/{path}` (one worker) and
  `{METHOD} /v1/rl/engine/{path}?selector=...` (every matching worker, concurrently; 200 when
  all succeeded, else 207; a worker answering >= 400 goes to `failed` as `upstream_error`, one
  out of reach as `upstream_unreachable`). The selector takes `key=value` / `key!=value`
  terms joined by commas over the labels `engine` (always "sglang"), `id`, `worker_type`.
- Every other route, in particular `/pause_generation`, `/continue_generation`,
  `/update_weights_from_disk` and `/abort_request`, answers 404: outside `/v1/rl` the gateway
  does not route weight updates.

Workers may be listed as `url@rank` (smg's data-parallel ranks): requests go to `url`, and the
RL control plane lists one worker per URL (`dp_ranks` = its ranks). With `worker_api_key` the
gateway sends `Authorization: Bearer <key>` to the workers, so a test can run workers that only
the gateway may call.

Binds 127.0.0.1 only. Not covered: policies other than round robin, circuit breakers,
worker registration (`POST /workers`), streaming, `in`/`notin` selectors, `routed_dp_rank`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx
import trio

from engines.control_plane import control_targets
from engines.local.asgi import App, Request, Response, json_response, object_error


@dataclass
class GatewayStats:
    forwarded: dict[str, int] = field(default_factory=dict)  # worker url -> /generate calls
    refused: int = 0  # requests with a list rid or a batch


def _is_batch(body: dict) -> bool:
    ids, text = body.get("input_ids"), body.get("text")
    return isinstance(text, list) or (
        isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    )


def build_gateway_app(listed: Sequence[str], http: httpx.AsyncClient, stats: GatewayStats,
                      worker_api_key: str | None = None, server_info_version: bool = True
                      ) -> App:  # fmt: skip
    app = App()
    workers = control_targets(listed)
    order = itertools.cycle(range(len(workers)))
    headers = {"content-type": "application/json"}
    if worker_api_key:
        headers["authorization"] = f"Bearer {worker_api_key}"

    async def forward(url: str, request: Request) -> Response:
        answer = await http.request(
            request.method, url + request.path, content=request.body, headers=headers
        )
        kind = answer.headers.get("content-type", "application/json")
        return Response(answer.status_code, answer.content, kind)

    async def to_one_worker(request: Request) -> Response:
        """The next worker that answers (the gateway retries unreachable workers)."""
        last = "no worker"
        for _ in range(len(workers)):
            url = workers[next(order)]
            try:
                response = await forward(url, request)
            except httpx.TransportError as exc:
                last = f"{url}: {type(exc).__name__}"
                continue
            if request.path == "/generate":
                stats.forwarded[url] = stats.forwarded.get(url, 0) + 1
            return response
        return object_error(f"no healthy worker ({last})", 503)

    @app.route("/generate", methods=("POST",), cancel_on_disconnect=True)
    async def generate(request: Request) -> Response:
        try:
            body = json.loads(request.body or b"{}")
        except ValueError as exc:
            return object_error(f"Failed to parse the request body as JSON: {exc}", 400)
        if not isinstance(body, dict) or not isinstance(body.get("rid", ""), str | None):
            stats.refused += 1
            return object_error("rid: invalid type: sequence, expected a string", 400)
        if _is_batch(body):
            stats.refused += 1
            return object_error("batch requests are not supported by this gateway", 400)
        return await to_one_worker(request)

    for path in ("/model_info", "/get_model_info"):
        app.route(path)(to_one_worker)

    async def server_info(request: Request) -> Response:
        """A worker's, or (`server_info_version=False`) without `version`, as smg's own may be."""
        response = await to_one_worker(request)
        if server_info_version or response.status != 200:
            return response
        info = json.loads(response.body)
        info.pop("version", None)
        return json_response(info)

    for path in ("/server_info", "/get_server_info"):
        app.route(path)(server_info)

    async def probe(url: str) -> bool:
        try:
            return (await http.get(url + "/health", timeout=5.0)).status_code == 200
        except httpx.TransportError:
            return False

    @app.route("/workers")
    async def list_workers(request: Request) -> Response:
        rows = [
            {"id": f"worker-{i}", "url": entry, "model_id": None, "priority": 50, "cost": 1,
             "worker_type": "regular", "is_healthy": await probe(url), "load": 0,
             "connection_mode": "http"}
            for i, (entry, url) in enumerate((e, control_targets([e])[0]) for e in listed)
        ]  # fmt: skip
        return json_response({"workers": rows, "total": len(rows), "stats": {}})

    @app.route("/list_workers")
    async def legacy_list(request: Request) -> Response:
        return json_response({"urls": list(listed)})

    add_rl_routes(app, listed, http, headers)

    async def health(request: Request) -> Response:
        healthy = [await probe(url) for url in workers]
        return Response(200 if any(healthy) else 503, b"", "")

    for path in ("/health", "/health_generate", "/readiness", "/liveness"):
        app.route(path)(health)

    @app.route("/get_loads")
    async def loads(request: Request) -> Response:
        return json_response({"workers": [{"worker": url, "load": 0} for url in workers]})

    @app.route("/flush_cache", methods=("POST",))
    async def flush(request: Request) -> Response:
        for url in workers:
            await forward(url, request)
        return Response(200, b"", "")

    return app


def add_rl_routes(app: App, listed: Sequence[str], http: httpx.AsyncClient,
                  headers: dict[str, str]) -> None:  # fmt: skip
    """smg's `/v1/rl/*` (module docstring): one record per worker URL, fan-out with reports."""
    urls = control_targets(listed)
    ids = {f"worker-{i}": url for i, url in enumerate(urls)}

    async def record(wid: str) -> dict:
        url = ids[wid]
        try:
            info = (await http.get(url + "/model_info", headers=headers, timeout=5.0)).json()
        except (httpx.HTTPError, ValueError):
            info = {}
        return {"id": wid, "url": url, "base_url": url, "engine": "sglang", "engine_version": None,
                "model_id": info.get("model_path"), "worker_type": "regular",
                "connection_mode": "http", "tp_size": 1, "dp_size": None, "pp_size": 1,
                "dp_ranks": sum(1 for e in listed if control_targets([e])[0] == url),
                "role": None, "health": "healthy" if info else "unhealthy",
                "weight_version": info.get("weight_version"), "control_url": url,
                "labels": {}, "capabilities": {}}  # fmt: skip

    async def call(wid: str, request: Request, path: str) -> tuple[dict | None, dict | None]:
        """(result row, None) when the worker answered < 400, else (None, failure row)."""
        url = ids[wid]
        started = trio.current_time()
        try:
            answer = await http.request(request.method, f"{url}/{path}",
                                        content=request.body or None, headers=headers)  # fmt: skip
        except httpx.TransportError as exc:
            return None, {"worker_id": wid, "url": url, "status": None,
                          "error": "upstream_unreachable", "message": f"{type(exc).__name__}: {exc}"}  # fmt: skip
        try:
            body = answer.json()
        except ValueError:
            body = answer.text
        if answer.status_code >= 400:
            return None, {"worker_id": wid, "url": url, "status": answer.status_code,
                          "error": "upstream_error", "message": answer.text}  # fmt: skip
        latency_ms = int((trio.current_time() - started) * 1000)
        return {
            "url": url,
            "status": answer.status_code,
            "latency_ms": latency_ms,
            "body": body,
        }, None

    def matches(wid: str, selector: str) -> bool:
        labels = {"engine": "sglang", "id": wid, "worker_type": "regular"}
        for term in selector.split(","):
            key, op, value = re.fullmatch(r"\s*([\w.\-/]+)\s*(!=|==|=)\s*(\S*)\s*", term).groups()
            if (labels.get(key) == value) != (op != "!="):
                return False
        return True

    @app.route("/v1/rl/workers")
    async def rl_workers(request: Request) -> Response:
        return json_response({"workers": [await record(wid) for wid in ids]})

    @app.route("/v1/rl/workers/{id}", methods=("GET", "POST", "PUT", "DELETE"))
    async def rl_worker(request: Request) -> Response:
        wid, _, rest = request.path_params["id"].partition("/engine/")
        if wid not in ids:
            return json_response({"error": "worker_not_found", "message": wid}, 404)
        if not rest:
            return json_response(await record(wid))
        row, failure = await call(wid, request, rest)
        if failure is not None:
            return json_response(failure, 502)
        return json_response({"worker_id": wid, **row})

    @app.route("/v1/rl/engine/{id}", methods=("GET", "POST", "PUT", "DELETE"))
    async def rl_fanout(request: Request) -> Response:
        selector = (request.query.get("selector") or [""])[0]
        if not selector.strip():
            return json_response({"error": "selector_required", "message":
                                  "a non-empty `selector` query parameter is required"}, 400)  # fmt: skip
        try:
            targets = [wid for wid in ids if matches(wid, selector)]
        except AttributeError:
            return json_response({"error": "invalid_selector", "message": selector}, 400)
        if not targets:
            return json_response({"error": "no_match", "message": selector}, 404)
        results: dict[str, dict] = {}
        failed: list[dict] = []

        async def one(wid: str) -> None:
            row, failure = await call(wid, request, request.path_params["id"])
            if failure is None:
                results[wid] = row
            else:
                failed.append(failure)

        async with trio.open_nursery() as nursery:
            for wid in targets:
                nursery.start_soon(one, wid)
        report = {"results": results, "failed": failed, "total": len(targets),
                  "succeeded": len(results)}  # fmt: skip
        return json_response(report, 207 if failed else 200)


@contextlib.asynccontextmanager
async def open_gateway(
    workers: Sequence[str],
    *,
    port: int = 0,
    worker_api_key: str | None = None,
    server_info_version: bool = True,
) -> AsyncIterator[tuple[str, GatewayStats]]:
    """Serve the imitation on 127.0.0.1 inside the caller's task; yields (url, stats)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    stats = GatewayStats()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    timeout = httpx.Timeout(600.0, connect=5.0)
    async with httpx.AsyncClient(timeout=timeout) as http, trio.open_nursery() as nursery:
        app = build_gateway_app(
            [w.rstrip("/") for w in workers], http, stats, worker_api_key, server_info_version
        )
        binds = await nursery.start(serve, app, config)
        try:
            yield binds[0], stats
        finally:
            nursery.cancel_scope.cancel()
