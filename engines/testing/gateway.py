"""A small imitation of sgl-model-gateway (PyPI `sglang-router`) for tests and demos.

It speaks the gateway's request shapes as far as this project uses them (sglang_protocol.md §6):
- `POST /generate` is forwarded to ONE worker (round robin over healthy ones; a worker that
  cannot be reached is skipped, as the gateway retries). The body must be one request: a list
  `rid` or a batch of prompts is refused with 400, since the gateway takes one string `rid`.
- `GET /workers` (`{"workers": [{"id", "url", "is_healthy", ...}], "total": N}`),
  `GET /list_workers` (legacy), `GET /health`, `/health_generate`, `/liveness`, `/readiness`,
  `GET /get_loads`, `POST /flush_cache` (sent to every worker), and the info routes answered by
  a worker.
- Every other route, in particular `/pause_generation`, `/continue_generation`,
  `/update_weights_from_disk` and `/abort_request`, answers 404: the gateway does not route
  weight updates; a driver calls each worker itself.

Binds 127.0.0.1 only. Not covered: policies other than round robin, circuit breakers,
worker registration (`POST /workers`), streaming.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx
import trio

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


def build_gateway_app(workers: Sequence[str], http: httpx.AsyncClient, stats: GatewayStats) -> App:
    app = App()
    order = itertools.cycle(range(len(workers)))

    async def forward(url: str, request: Request) -> Response:
        answer = await http.request(
            request.method,
            url + request.path,
            content=request.body,
            headers={"content-type": "application/json"},
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

    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        app.route(path)(to_one_worker)

    async def probe(url: str) -> bool:
        try:
            return (await http.get(url + "/health", timeout=5.0)).status_code == 200
        except httpx.TransportError:
            return False

    @app.route("/workers")
    async def list_workers(request: Request) -> Response:
        rows = [
            {"id": f"worker-{i}", "url": url, "model_id": None, "priority": 50, "cost": 1,
             "worker_type": "regular", "is_healthy": await probe(url), "load": 0,
             "connection_mode": "http"}
            for i, url in enumerate(workers)
        ]  # fmt: skip
        return json_response({"workers": rows, "total": len(rows), "stats": {}})

    @app.route("/list_workers")
    async def legacy_list(request: Request) -> Response:
        return json_response({"urls": list(workers)})

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


@contextlib.asynccontextmanager
async def open_gateway(
    workers: Sequence[str], *, port: int = 0
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
        app = build_gateway_app([w.rstrip("/") for w in workers], http, stats)
        binds = await nursery.start(serve, app, config)
        try:
            yield binds[0], stats
        finally:
            nursery.cancel_scope.cancel()
