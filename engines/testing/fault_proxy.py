"""`FaultProxy`: an HTTP/1.1 proxy on 127.0.0.1 that injects failures between a client and an
engine, for tests and demos of what the pool and the rollout manager survive.

Each request whose path is in `FaultPlan.paths` draws one fault (seeded, so runs repeat):
- "reset": the connection is closed without an answer;
- "delay": forwarded after `delay_s`;
- "truncate": forwarded, and half of the answer's bytes are sent before the connection closes;
- "500": answered `500 {"error": {"message": "injected fault"}}` without forwarding;
- "hang": no answer for `hang_s` (or until the client closes), then the connection closes;
- "nonjson": answered `200` with an HTML body (a misrouted load balancer) without forwarding;
- otherwise the request is forwarded as is. Every other path is always forwarded.
`FaultPlan.script` names the faults of the first requests in order ("pass": forwarded), so a
test can place one fault exactly; the seeded draws take over after it.

One request per connection (`Connection: close` both ways), so a fault hits exactly one request.
Every wait is bounded (`io_timeout_s` per read, `hang_s`); `counts` tallies each fault and each
forwarded request; `rids` lists the rid of each request drawn for, in order (an engine's request
log); `longest_s` the longest time a request of each path was outstanding at the proxy (head
read to answer sent or connection closed). `on_request(path)`, if set, is called as each
request's head arrives (before its fault), e.g. to kill the client mid-weight-push;
`on_answer(path, body, answer)`, if set, with each forwarded request's body and the engine's
whole answer (head and body), e.g. to record what the engine sampled. Only bodies with
`Content-Length` are read (what httpx sends).
"""

from __future__ import annotations

import contextlib
import json
import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import trio

FAULTS = ("reset", "delay", "truncate", "500", "hang", "nonjson")
_ERROR = b'{"error": {"message": "injected fault"}}'
_HTML = b"<html><body>502 Bad Gateway (injected fault)</body></html>"


@dataclass(frozen=True)
class FaultPlan:
    rates: Mapping[str, float] = field(default_factory=dict)  # fault -> probability per request
    script: tuple[str, ...] = ()  # faults of the first requests, in order ("pass": none)
    paths: tuple[str, ...] = ("/generate",)
    delay_s: float = 0.5
    hang_s: float = 5.0
    io_timeout_s: float = 120.0
    seed: int = 0


class FaultProxy:
    """`url = await nursery.start(FaultProxy(upstream_url, plan).serve)`."""

    def __init__(self, upstream: str, plan: FaultPlan) -> None:
        host_port = upstream.split("://", 1)[-1].rstrip("/")
        host, port = host_port.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.plan = plan
        self.counts: Counter[str] = Counter()
        self.longest_s: dict[str, float] = {}
        self.on_request: Callable[[str], None] | None = None
        self.on_answer: Callable[[str, bytes, bytes], None] | None = None
        self.rids: list[str] = []  # of each request on `plan.paths`, as sent (a batch: each item)
        self.enabled = True
        self._rng = random.Random(plan.seed)
        self._n_drawn = 0

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(f"http://127.0.0.1:{port}")

    def replan(self, plan: FaultPlan) -> None:
        """Follow `plan` from the next request on: its script first, then its own seeded draws."""
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._n_drawn = 0

    def _draw(self, path: str) -> str | None:
        if not self.enabled or path not in self.plan.paths:
            return None
        self._n_drawn += 1
        if self._n_drawn <= len(self.plan.script):
            fault = self.plan.script[self._n_drawn - 1]
            return None if fault == "pass" else fault
        roll = self._rng.random()
        for fault in FAULTS:
            roll -= self.plan.rates.get(fault, 0.0)
            if roll < 0:
                return fault
        return None

    async def _handle(self, client: trio.SocketStream) -> None:
        async with client:
            try:
                with trio.fail_after(self.plan.io_timeout_s):
                    head, body = await _read_message(client)
            except (trio.TooSlowError, trio.BrokenResourceError, ValueError):
                return
            path = head.split(b" ", 2)[1].split(b"?")[0].decode("latin-1")
            if self.on_request is not None:
                self.on_request(path)
            started = trio.current_time()
            try:
                await self._answer(client, head, body, path)
            finally:
                took = trio.current_time() - started
                self.longest_s[path] = max(self.longest_s.get(path, 0.0), took)

    async def _answer(self, client: trio.SocketStream, head: bytes, body: bytes, path: str) -> None:
        fault = self._draw(path)
        if self.enabled and path in self.plan.paths:
            self.rids.extend(_rids_of(body))
        self.counts[fault or "forwarded"] += 1
        if fault == "reset":
            return
        if fault == "hang":  # until hang_s, or until the client gives up and closes
            with (
                trio.move_on_after(self.plan.hang_s),
                contextlib.suppress(trio.BrokenResourceError),
            ):
                while await client.receive_some(65536):
                    pass
            return
        if fault == "500":
            await _send(client, b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: "
                        b"application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                        % len(_ERROR) + _ERROR)  # fmt: skip
            return
        if fault == "nonjson":
            await _send(client, b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\n"
                        b"content-length: %d\r\nconnection: close\r\n\r\n"
                        % len(_HTML) + _HTML)  # fmt: skip
            return
        if fault == "delay":
            await trio.sleep(self.plan.delay_s)
        try:
            with trio.fail_after(self.plan.io_timeout_s):
                answer = await self._forward(head, body)
        except (trio.TooSlowError, OSError, trio.BrokenResourceError):
            return  # the engine is gone or stuck: the client sees a dropped connection
        if self.on_answer is not None:
            self.on_answer(path, body, answer)
        await _send(client, answer[: len(answer) // 2] if fault == "truncate" else answer)

    async def _forward(self, head: bytes, body: bytes) -> bytes:
        lines = [line for line in head.split(b"\r\n") if line]
        kept = [x for x in lines[1:] if not x.lower().startswith((b"connection:", b"keep-alive:"))]
        request = b"\r\n".join([lines[0], *kept, b"connection: close"]) + b"\r\n\r\n" + body
        upstream = await trio.open_tcp_stream(*self.upstream)
        async with upstream:
            await upstream.send_all(request)
            chunks = []
            while chunk := await upstream.receive_some(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def _rids_of(body: bytes) -> list[str]:
    try:
        rid = json.loads(body).get("rid")
    except (ValueError, AttributeError):
        return []
    return [r for r in (rid if isinstance(rid, list) else [rid]) if isinstance(r, str)]


async def _read_message(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk or len(buffer) > 1 << 20:
            raise ValueError("connection closed before a whole request head")
        buffer += chunk
    head, body = buffer.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ValueError("connection closed inside a request body")
        body += chunk
    return head, body


async def _send(stream: trio.SocketStream, data: bytes) -> None:
    with contextlib.suppress(trio.BrokenResourceError):
        await stream.send_all(data)
