"""A minimal ASGI layer for the local engine: routing, JSON/SSE responses, auth, disconnects.

Hand-written instead of a framework because the engine needs only a dozen routes and
exact control over SGLang's error shapes. Guarantees: a handler exception becomes a 500 JSON
answer and never takes the server down; route, method, key and `Content-Length` are checked on
the headers before the body is read, and a body over `max_body_bytes` is answered 413 while it
is being read (so an unauthenticated or oversized body never lands in memory); with `api_key`, every route except `/health*` needs
`Authorization: Bearer <key>` (401 `{"error": "Unauthorized"}`); control routes (marked `admin`)
follow SGLang 0.5.23's ADMIN_OPTIONAL level: with `admin_api_key` set only that key opens them,
else `api_key` does, else they are open; routes marked
`cancel_on_disconnect` are cancelled when the client goes away (so generation stops).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import trio

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024  # default of --max-request-bytes
AUTH_EXEMPT = ("/health", "/health_generate")


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


@dataclass
class StreamingResponse:
    """Server-sent events: each item of `events` is one already-formatted chunk."""

    events: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(obj, ensure_ascii=False, allow_nan=False).encode())


def text_response(text: str, status: int = 200) -> Response:
    return Response(status, text.encode(), "text/plain; charset=utf-8")


def error_response(message: str, status: int = 400) -> Response:
    """Native handler errors: `{"error": {"message": ...}}`."""
    return json_response({"error": {"message": message}}, status)


def object_error(message: str, status: int, err_type: str | None = None) -> Response:
    """Validation/HTTPException/OpenAI errors: `{"object": "error", ...}`."""
    body = {
        "object": "error",
        "message": message,
        "type": err_type or str(status),
        "param": None,
        "code": status,
    }
    return json_response(body, status)


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, allow_nan=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    path_params: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        """The body as JSON; an empty body is `{}` (SGLang's control routes accept none)."""
        if not self.body.strip():
            return {}
        return json.loads(self.body)


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


@dataclass
class Route:
    methods: tuple[str, ...]
    handler: Handler
    cancel_on_disconnect: bool = False
    admin: bool = False  # a control route (SGLang's AuthLevel.ADMIN_OPTIONAL)


class App:
    def __init__(
        self,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.max_body_bytes = max_body_bytes
        self.routes: dict[str, Route] = {}
        self.prefix_routes: list[tuple[str, Route]] = []  # "/v1/models/" + {id}

    def route(self, path: str, methods=("GET",), *, cancel_on_disconnect: bool = False,
              admin: bool = False):  # fmt: skip
        def register(handler: Handler) -> Handler:
            entry = Route(tuple(methods), handler, cancel_on_disconnect, admin)
            if path.endswith("/{id}"):
                self.prefix_routes.append((path[: -len("{id}")], entry))
            else:
                self.routes[path] = entry
            return handler

        return register

    def _find(self, path: str) -> tuple[Route | None, dict[str, str]]:
        if path in self.routes:
            return self.routes[path], {}
        for prefix, entry in self.prefix_routes:
            if path.startswith(prefix) and len(path) > len(prefix):
                return entry, {"id": path[len(prefix) :]}
        return None, {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request = Request(
            method=scope["method"],
            path=scope["path"].rstrip("/") or "/",
            query=parse_qs(scope.get("query_string", b"").decode()),
            headers=headers,
            body=b"",
        )
        # Route, method and key are checked on the headers, before one byte of body is read.
        refusal = self._refuse_on_headers(request)
        if refusal is None:
            body = await self._read_body(receive, headers)
            if body is None:  # the client went away
                return
            if isinstance(body, Response):
                refusal = body
            else:
                request.body = body
        if refusal is not None:
            await _send(send, refusal)
            return
        response = await self._dispatch(request, receive)
        if response is None:  # the client went away
            return
        if isinstance(response, StreamingResponse):
            await self._stream(response, send, receive)
        else:
            await _send(send, response)

    def _refuse_on_headers(self, request: Request) -> Response | None:
        route, params = self._find(request.path)
        if route is None:
            return object_error("Not Found", 404)
        if request.method not in route.methods:
            return object_error("Method Not Allowed", 405)
        key = (self.admin_api_key or self.api_key) if route.admin else self.api_key
        if key and request.path not in AUTH_EXEMPT and not self.authorized(request, key):
            return json_response({"error": "Unauthorized"}, 401)
        request.path_params = params
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    @staticmethod
    def authorized(request: Request, key: str) -> bool:
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

    def admits(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request head may hold a connection slot (`http11.serve_http`'s `admit`):
        without `api_key` every head may; with it, only one carrying `api_key` or
        `admin_api_key`. Route-level checks (401 on the route, 404) stay in `__call__`."""
        if not self.api_key:
            return True
        given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        keys = [key for key in (self.api_key, self.admin_api_key) if key]
        return any(hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys)

    def _too_large(self) -> Response:
        return object_error(
            f"Request body too large: the limit is {self.max_body_bytes} bytes "
            "(--max-request-bytes).",
            413,
        )

    async def _read_body(self, receive, headers: dict[str, str]) -> bytes | Response | None:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:  # a chunked body with no Content-Length
                return self._too_large()
            if not message.get("more_body"):
                return bytes(body)

    async def _dispatch(self, request: Request, receive) -> Response | StreamingResponse | None:
        route, _ = self._find(request.path)
        assert route is not None
        try:
            if not route.cancel_on_disconnect:
                return await route.handler(request)
            result: list[Response | StreamingResponse] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                result.append(await route.handler(request))
                nursery.cancel_scope.cancel()
            return result[0] if result else None
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.path)
            return object_error(f"Internal server error: {exc!r}", 500, "InternalServerError")

    async def _stream(self, response: StreamingResponse, send, receive) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [
                    (b"content-type", response.content_type.encode()),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        events = response.events
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                nursery.cancel_scope.cancel()
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()


async def _cancel_on_disconnect(receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _send(send, response: Response) -> None:
    headers = [(b"content-length", str(len(response.body)).encode())]
    if response.content_type:
        headers.append((b"content-type", response.content_type.encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})
