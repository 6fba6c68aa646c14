"""The local engine's HTTP/1.1 server: h11 on trio, with the bounds a shared machine needs.

Why not hypercorn: it has no deadline for reading a request head (a client trickling one
header byte at a time holds a connection forever), no bound on open connections, and it keeps
a connection whose client went away until its keep-alive timer fires. This server serves one
ASGI app (`asgi.App`) and guarantees:

- a connection takes one of `max_connections` slots only once it has sent a request head
  that is admitted (`admit`: the engine's API key when it has one); one admitted head more
  than the slots is answered 503 and closed at once (it never waits in a queue);
- before that, a connection waits in a lobby of `max_pre_auth_connections`: it must send its
  head within `pre_auth_timeout_s` of being accepted, and when the lobby is full the oldest
  idle waiter (1 s in the lobby without a whole head sent) is closed to let the newcomer in,
  so clients that send their head at once always get through however many idle sockets an
  attacker holds (issue 26), and a burst of real clients larger than the lobby is served
  whole (`_Lobby` says how it tells them apart); a head that is not
  admitted is answered from the lobby (401, or an auth-exempt route) with `connection: close`;
- an admitted connection keeps its slot while it idles between requests (keep-alive): its
  client proved its key, and the slot ends with `keep_alive_timeout_s`;
- a request head must arrive within `header_timeout_s` of its first byte (and within
  `keep_alive_timeout_s` of the previous response when the connection is idle), else the
  connection is closed; heads are capped at 16 KiB (h11's default);
- the body is read only when the app asks for it (`receive()`), so a request the app refuses
  on its headers (401, 413) is answered without its body being read; the whole body must
  arrive within `read_timeout_s` of the head (else 408 and close);
- when the client closes its end while the app runs, `receive()` reports `http.disconnect`
  (the app cancels the request's generation) and the connection is closed;
- a response the client does not read within `send_timeout_s` closes the connection.

Not covered: HTTP/2, TLS, pipelined requests (read one at a time), websockets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
import trio

logger = logging.getLogger(__name__)

Admit = Callable[[list[tuple[bytes, bytes]]], bool]
ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Any]
_RECV = 64 * 1024
_PEEK = 16 * 1024  # h11's cap on a request head
_LOBBY_GRACE_S = 1.0  # a lobby waiter this old without a whole head sent is idle (`_Lobby`)
_MAX_UNREAD = 64 * 1024  # bytes a client may send past its request while it is answered
_REASONS = {400: "Bad Request", 408: "Request Timeout", 500: "Internal Server Error",
            503: "Service Unavailable"}  # fmt: skip


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 512
    max_pre_auth_connections: int = 64  # accepted, head not yet read and admitted
    pre_auth_timeout_s: float = 5.0  # from accept to an admitted head
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 15.0  # > httpx's 5 s pool expiry, so idle clients close first
    read_timeout_s: float = 30.0
    send_timeout_s: float = 30.0


@dataclass
class ServerStatistics:
    open_connections: int = 0
    refused_connections: int = 0  # over max_connections
    pre_auth_connections: int = 0  # in the lobby: head not yet read and admitted
    evicted_connections: int = 0  # closed in the lobby to make room for a newer one
    timed_out_connections: int = 0  # head, body or send deadline passed


class _Closed(Exception):
    """The connection is done (peer closed, deadline passed, protocol error)."""


class _Connection:
    def __init__(self, stream: trio.SocketStream, limits: ConnectionLimits, stats) -> None:
        self.stream, self.limits, self.stats = stream, limits, stats
        self.conn = h11.Connection(h11.SERVER)
        self.peer_gone = False
        self.closing = False  # answer with `connection: close`, then close

    async def _read(self, timeout: float, *, idle: bool = False) -> None:
        try:
            with trio.fail_after(timeout):
                data = await self.stream.receive_some(_RECV)
        except trio.TooSlowError:
            if not idle:  # an idle keep-alive connection running out is no client's fault
                self.stats.timed_out_connections += 1
            raise _Closed("read deadline passed") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.peer_gone = True
        self.conn.receive_data(data)

    async def _next_event(self, timeout: float) -> Any:
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise _Closed(f"bad request: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            if self.peer_gone:
                raise _Closed("peer closed")
            await self._read(timeout)

    async def _send(self, event: Any) -> None:
        data = self.conn.send(event)
        if not data:
            return
        try:
            with trio.fail_after(self.limits.send_timeout_s):
                await self.stream.send_all(data)
        except trio.TooSlowError:
            self.stats.timed_out_connections += 1
            raise _Closed("send deadline passed") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.peer_gone = True
            raise _Closed("peer closed while sending") from None

    async def _read_head(self, first: bool) -> h11.Request | None:
        """The next request head, or None when the client closed an idle connection."""
        if not first:
            # idle: wait for the first byte of the next request within the keep-alive time
            if self.conn.trailing_data[0] == b"" and not self.peer_gone:
                try:
                    await self._read(self.limits.keep_alive_timeout_s, idle=True)
                except _Closed:
                    return None
            if self.peer_gone and not self.conn.trailing_data[0]:
                return None
        deadline = trio.current_time() + self.limits.header_timeout_s
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                await self._refuse(exc.error_status_hint, f"Bad request: {exc}")
                return None
            if isinstance(event, h11.Request):
                return event
            if event is h11.NEED_DATA:
                if self.peer_gone:
                    return None
                await self._read(max(0.0, deadline - trio.current_time()))
                continue
            return None  # ConnectionClosed or PAUSED

    async def _refuse(self, status: int, message: str) -> None:
        """A last answer written as raw bytes (h11 may be in an error state), then close."""
        body = json.dumps({"error": {"message": message}}).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        with trio.move_on_after(1.0):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.stream.send_all(head.encode() + body)

    async def serve(self, app: ASGIApp, server: tuple[str, int], admit: Admit,
                    lobby: _Lobby, slots: trio.Semaphore) -> None:  # fmt: skip
        request = await self._wait_in_lobby(app, server, admit, lobby)
        if request is None:
            return
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            self.stats.refused_connections += 1
            await self._refuse(503, "Too many open connections; try again later.")
            return
        self.stats.open_connections += 1
        try:
            while request is not None:
                self.closing = not admit(request.headers)  # a later request without the key
                await self._run_app(app, request, server)
                if self.closing or self.peer_gone or self.conn.our_state is not h11.DONE:
                    return
                if self.conn.their_state is not h11.DONE:
                    return  # the app did not read the body: close rather than read it now
                try:
                    self.conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return
                request = await self._read_head(first=False)
        finally:
            self.stats.open_connections -= 1
            slots.release()

    async def _wait_in_lobby(self, app: ASGIApp, server, admit: Admit, lobby: _Lobby):
        """The first request head if it is admitted; else None (answered or closed)."""
        with trio.CancelScope() as evicted:
            lobby.enter(evicted, self.stream)
            try:
                with trio.move_on_after(self.limits.pre_auth_timeout_s) as late:
                    request = await self._read_head(first=True)
                if late.cancelled_caught:
                    self.stats.timed_out_connections += 1
                    return None
                if request is None or admit(request.headers):
                    return request
                self.closing = True
                await self._run_app(app, request, server)  # 401, or /health without the key
                return None
            finally:
                lobby.leave(evicted)
        return None  # evicted: the lobby was full and this was its oldest waiter

    async def _run_app(self, app: ASGIApp, request: h11.Request, server) -> None:
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode(),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": path,
            "raw_path": path.encode("latin-1"),
            "query_string": query.encode("latin-1"),
            "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers],
            "client": None,
            "server": server,
        }
        started = False
        body_timed_out = False
        body_deadline = trio.current_time() + self.limits.read_timeout_s

        async def receive() -> dict:
            if self.conn.their_state is h11.SEND_BODY:
                if self.conn.they_are_waiting_for_100_continue:
                    await self._send(h11.InformationalResponse(status_code=100, headers=[]))
                nonlocal body_timed_out
                try:
                    event = await self._next_event(max(0.0, body_deadline - trio.current_time()))
                except _Closed:
                    body_timed_out = not self.peer_gone
                    return {"type": "http.disconnect"}
                if isinstance(event, h11.Data):
                    return {"type": "http.request", "body": bytes(event.data), "more_body": True}
                return {"type": "http.request", "body": b"", "more_body": False}
            # the body is read: wait for the client to go away (EOF), for as long as it takes
            while not self.peer_gone and len(self.conn.trailing_data[0]) <= _MAX_UNREAD:
                try:
                    await self._read(math.inf)
                except _Closed:
                    break
            self.peer_gone = True  # closed, or flooding us: either way this connection ends
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if self.closing or self.conn.their_state is not h11.DONE:
                    headers.append((b"connection", b"close"))  # body unread: no reuse
                await self._send(h11.Response(status_code=message["status"], headers=headers))
                started = True
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if body:
                    await self._send(h11.Data(data=body))
                if not message.get("more_body", False):
                    await self._send(h11.EndOfMessage())

        try:
            await app(scope, receive, send)
        except _Closed:
            return
        except Exception:
            logger.exception("the app failed on %s %s", scope["method"], path)
            if not started:
                await self._refuse(500, "Internal server error")
            return
        if body_timed_out and not started:
            await self._refuse(408, "The request body did not arrive in time (--read-timeout).")
        elif not started and not self.peer_gone:
            await self._refuse(500, "The app sent no response")


def _whole_head_pending(stream: trio.SocketStream) -> bool:
    """Whether the client has sent a whole request head that this server has not read yet
    (still in the kernel's buffer): a real client, about to be served, not an idle socket."""
    try:
        fd = stream.socket.fileno()
        with socket.socket(fileno=os.dup(fd)) as peek:
            pending = peek.recv(_PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # nothing pending (EAGAIN), or the socket is gone
        return False
    return b"\r\n\r\n" in pending


class _Lobby:
    """Connections not yet admitted, oldest first. A newcomer over the cap evicts the oldest
    waiter that is idle: it has been waiting `_LOBBY_GRACE_S` and has not sent a whole head.

    Why the two conditions: a burst of real clients larger than the lobby (the agent proxy
    opens up to `rollout.max_concurrency` connections at once) reaches an engine in its own
    process as a burst of accepts before any head is read, and each client sends its head a
    moment after its connect. A waiter younger than `_LOBBY_GRACE_S`, or whose head waits unread in
    the kernel's buffer, is such a client: kept, and the newcomer waits beside it over the
    cap, up to `hard_cap` waiters (the server's connection slots), past which the oldest goes
    whatever it is. An idle socket past the grace is what an attacker holds: evicted as before.
    """

    def __init__(self, limits: ConnectionLimits, stats: ServerStatistics) -> None:
        self.capacity, self.stats = limits.max_pre_auth_connections, stats
        self.hard_cap = max(self.capacity, limits.max_connections)
        # insertion order is age: scope -> (stream to peek at, when it entered)
        self.waiting: dict[trio.CancelScope, tuple[trio.SocketStream, float]] = {}

    def _idle(self, stream: trio.SocketStream, entered: float, now: float) -> bool:
        return now - entered >= _LOBBY_GRACE_S and not _whole_head_pending(stream)

    def enter(self, scope: trio.CancelScope, stream: trio.SocketStream) -> None:
        now = trio.current_time()
        if len(self.waiting) >= self.capacity:
            idle = next((s for s, (st, t) in self.waiting.items() if self._idle(st, t, now)), None)
            if idle is None and len(self.waiting) >= self.hard_cap:
                idle = next(iter(self.waiting))  # never more waiters than connection slots
            if idle is not None:
                del self.waiting[idle]
                idle.cancel()
                self.stats.evicted_connections += 1
                if self.stats.evicted_connections == 1:  # then DEBUG: an attack repeats it
                    logger.warning("lobby full (%d connections without an admitted head): closed "
                                   "the oldest idle one", self.capacity)  # fmt: skip
                else:
                    logger.debug("lobby full: closed an idle connection (%d so far)",
                                 self.stats.evicted_connections)  # fmt: skip
        self.waiting[scope] = (stream, now)
        self.stats.pre_auth_connections = len(self.waiting)

    def leave(self, scope: trio.CancelScope) -> None:
        self.waiting.pop(scope, None)
        self.stats.pre_auth_connections = len(self.waiting)


def admit_all(headers: list[tuple[bytes, bytes]]) -> bool:
    return True


async def serve_http(
    app: ASGIApp,
    host: str,
    port: int,
    limits: ConnectionLimits,
    stats: ServerStatistics | None = None,
    *,
    admit: Admit = admit_all,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port until cancelled; `task_status.started([url])` once bound.

    `admit(headers)` says whether a request head may hold a connection slot (see the module
    docstring); the app still answers every request itself.
    """
    stats = stats if stats is not None else ServerStatistics()
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    slots = trio.Semaphore(limits.max_connections)
    lobby = _Lobby(limits, stats)

    async def handle(stream: trio.SocketStream) -> None:
        connection = _Connection(stream, limits, stats)
        try:
            await connection.serve(app, (bound[0], bound[1]), admit, lobby, slots)
        except _Closed as exc:
            logger.debug("connection closed: %s", exc)
        finally:
            await _close(stream)

    url = f"http://{bound[0]}:{bound[1]}"
    task_status.started([url])
    await trio.serve_listeners(handle, listeners)


async def _close(stream: trio.SocketStream) -> None:
    with trio.move_on_after(1.0) as scope:
        scope.shield = True
        await stream.aclose()
