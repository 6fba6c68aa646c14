"""OpenEnv's wire protocol, spoken from trio: one episode's WebSocket session and the HTTP routes.

The protocol is the one `openenv` 0.10.0's `EnvClient` speaks (`openenv/core/env_client.py`,
`env_server/http_server.py`): a WebSocket at `/ws` is one session with its own environment
instance; the client sends `{"type": "reset" | "step" | "state" | "close", "data": ...}` and
the server answers each with one `{"type": "observation" | "state" | "error", "data": ...}`.
A step's data is the action: for MCP tool environments `{"type": "list_tools"}` or
`{"type": "call_tool", "tool_name": ..., "arguments": {...}}`. HTTP: `GET /health`, and the
task provider's `POST /{env_name}/task_range` (`{"split", "start", "stop"}` -> `{"tasks"}`).

It is spoken here (wsproto over trio streams, httpx) rather than through `openenv`'s client,
which runs on asyncio: the trainer process never imports `openenv` (a 4-17 s import) and no
thread owns a second event loop. Only the env server needs the package.

Guarantees: every request has a deadline (`timeout_s`); every failure raises `OpenEnvError`
naming the server URL, what was asked and the cause (the server's own message for an error
frame); a session that timed out is closed, never reused out of step.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

from plumbing.errors import RolloutsError


class OpenEnvError(RolloutsError, RuntimeError):
    """An OpenEnv server could not be reached, broke off, or answered with an error."""


def _endpoint(url: str) -> tuple[str, int, bool, str]:
    parts = urlsplit(url)
    secure = parts.scheme in ("https", "wss")
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
        raise OpenEnvError(f"{url}: not an http(s):// or ws(s):// URL of an OpenEnv server")
    return parts.hostname, parts.port or (443 if secure else 80), secure, parts.path.rstrip("/")


def _cause(exc: BaseException) -> str:
    """`Type: message`, and the first underlying error (trio's connect wraps them)."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    inner = exc.__cause__
    while isinstance(inner, BaseExceptionGroup) and inner.exceptions:
        inner = inner.exceptions[0]
    return f"{text} ({_cause(inner)})" if inner is not None else text


class OpenEnvSession:
    """One WebSocket session at an env server: one environment instance, requests in order."""

    def __init__(self, url: str, stream: trio.abc.Stream, ws: WSConnection,
                 events: deque[Event], timeout_s: float) -> None:  # fmt: skip
        self.url = url
        self._stream = stream
        self._ws = ws
        self._events = events
        self._timeout_s = timeout_s
        self._broken: str | None = None

    async def reset(self, **kwargs: Any) -> dict[str, Any]:
        """The first observation (`{"observation", "reward", "done", ...}`) of a new episode."""
        return await self.request("reset", kwargs)

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        """The observation after `action` (`{"observation", "reward", "done", ...}`)."""
        return await self.request("step", action)

    async def request(self, kind: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one message and return the data of its answer.

        Raises:
            OpenEnvError: no answer within the deadline, the connection broke, or the server
                answered with an error frame (its message and code are in ours).
        """
        if self._broken is not None:
            raise OpenEnvError(f"{self.url}: the session is closed ({self._broken})")
        message = {"type": kind} if data is None else {"type": kind, "data": data}
        what = f"{kind} {json.dumps(data)[:200]}" if data else kind
        with trio.move_on_after(self._timeout_s) as deadline:
            try:
                await self._send_text(json.dumps(message))
                reply = await self._receive_text()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._broken = "the connection broke"
                raise OpenEnvError(f"{self.url}: the connection broke during {what}: "
                                   f"{_cause(exc)}") from exc  # fmt: skip
        if deadline.cancelled_caught:
            self._broken = f"{kind} timed out"
            raise OpenEnvError(
                f"{self.url}: no answer to {what} within {self._timeout_s} s (raise "
                "env.openenv.step_timeout_s if the environment is slow)"
            )
        try:
            answer = json.loads(reply)
        except ValueError as exc:
            raise OpenEnvError(f"{self.url}: {what} was answered with non-JSON: "
                               f"{reply[:200]!r}") from exc  # fmt: skip
        if answer.get("type") == "error":
            err = answer.get("data") or {}
            raise OpenEnvError(f"{self.url}: the env server answered {what} with an error: "
                               f"{err.get('message', err)} (code {err.get('code', '?')})")  # fmt: skip
        return answer.get("data") or {}

    async def _send_text(self, text: str) -> None:
        await self._stream.send_all(self._ws.send(TextMessage(data=text)))

    async def _receive_text(self) -> str:
        parts: list[str] = []
        while True:
            while self._events:
                event = self._events.popleft()
                if isinstance(event, TextMessage):
                    parts.append(event.data)
                    if event.message_finished:
                        return "".join(parts)
                elif isinstance(event, Ping):
                    await self._stream.send_all(self._ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    self._broken = "closed by the server"
                    raise OpenEnvError(f"{self.url}: the server closed the session (code "
                                       f"{event.code}: {event.reason or 'no reason given'})")  # fmt: skip
            data = await self._stream.receive_some(65536)
            if not data:
                self._broken = "closed by the server"
                raise OpenEnvError(f"{self.url}: the server closed the connection")
            self._ws.receive_data(data)
            self._events.extend(self._ws.events())

    async def aclose(self) -> None:
        """Tell the server the episode is over (best effort, 2 s) and close the connection."""
        with trio.move_on_after(2.0):
            try:
                if self._broken is None:
                    await self._send_text(json.dumps({"type": "close"}))
                    await self._stream.send_all(self._ws.send(CloseConnection(code=1000)))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError,
                    LocalProtocolError):  # fmt: skip
                pass  # already gone or closing: nothing to tell
        self._broken = self._broken or "closed"
        await trio.aclose_forcefully(self._stream)


@asynccontextmanager
async def open_session(url: str, *, timeout_s: float = 60.0) -> AsyncIterator[OpenEnvSession]:
    """A WebSocket session at `url`'s `/ws`, closed when the block ends.

    Raises:
        OpenEnvError: the server cannot be reached or refused the WebSocket, within `timeout_s`.
    """
    host, port, secure, path = _endpoint(url)
    ws = WSConnection(ConnectionType.CLIENT)
    events: deque[Event] = deque()
    stream: trio.abc.Stream | None = None
    with trio.move_on_after(timeout_s) as deadline:
        try:
            if secure:
                stream = await trio.open_ssl_over_tcp_stream(host, port, https_compatible=True)
            else:
                stream = await trio.open_tcp_stream(host, port)
            await stream.send_all(ws.send(Request(host=f"{host}:{port}", target=f"{path}/ws")))
            await _handshake(url, stream, ws, events)
        except OSError as exc:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise OpenEnvError(f"{url}: cannot open a session at {url}/ws: {_cause(exc)} (is "
                               "the env server running there?)") from exc  # fmt: skip
        except BaseException:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise
    if deadline.cancelled_caught or stream is None:
        if stream is not None:
            await trio.aclose_forcefully(stream)
        raise OpenEnvError(f"{url}: no WebSocket handshake at {url}/ws within {timeout_s} s")
    session = OpenEnvSession(url, stream, ws, events, timeout_s)
    try:
        yield session
    finally:
        with trio.CancelScope(shield=True):
            await session.aclose()


async def _handshake(url: str, stream: trio.abc.Stream, ws: WSConnection,
                     events: deque[Event]) -> None:  # fmt: skip
    status, body = None, b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise OpenEnvError(f"{url}: the server closed the connection during the WebSocket "
                               f"handshake{f' (HTTP {status}: {body[:200]!r})' if status else ''}")  # fmt: skip
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                events.extend(ws.events())
                return
            if isinstance(event, RejectConnection):
                status = event.status_code
                if event.has_body:
                    continue
            elif isinstance(event, RejectData):
                body += event.data
                if not event.body_finished:
                    continue
            else:
                continue
            raise OpenEnvError(f"{url}: the server refused the WebSocket at {url}/ws (HTTP "
                               f"{status}: {body[:200]!r}); is this an OpenEnv server?")  # fmt: skip


async def check_server(url: str, *, timeout_s: float = 10.0) -> None:
    """Fail fast when nothing healthy answers `GET {url}/health`.

    Raises:
        OpenEnvError: names the URL and the cause (refused, timed out, an HTTP error).
    """
    import httpx  # only a run with an OpenEnv env pays for it

    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            answer = await client.get(f"{url.rstrip('/')}/health")
    except httpx.HTTPError as exc:
        raise OpenEnvError(f"{url}: the OpenEnv server does not answer GET /health: "
                           f"{_cause(exc)} (start it, or fix env.openenv.url)") from exc  # fmt: skip
    if answer.status_code != 200:
        raise OpenEnvError(f"{url}: GET /health answered HTTP {answer.status_code}: "
                           f"{answer.text[:300]}")  # fmt: skip


def fetch_tasks(url: str, env_name: str, split: str, *, limit: int | None = None,
                timeout_s: float = 60.0) -> list[Any]:  # fmt: skip
    """The task specs of `split` from the env's task provider (blocking; for worker threads).

    Raises:
        OpenEnvError: the route failed (501: the env has no task provider), naming URL and split.
    """
    import httpx

    route = f"{url.rstrip('/')}/{env_name}/task_range"
    try:
        answer = httpx.post(route, json={"split": split, "start": 0, "stop": limit},
                            timeout=timeout_s, trust_env=False)  # fmt: skip
    except httpx.HTTPError as exc:
        raise OpenEnvError(f"{route}: cannot read the tasks of split {split!r}: "
                           f"{_cause(exc)}") from exc  # fmt: skip
    if answer.status_code != 200:
        hint = " (the env has no task provider: give prompt files in data: instead)" \
            if answer.status_code == 501 else ""  # fmt: skip
        raise OpenEnvError(f"{route}: split {split!r} answered HTTP {answer.status_code}: "
                           f"{answer.text[:300]}{hint}")  # fmt: skip
    return list(answer.json().get("tasks") or [])
