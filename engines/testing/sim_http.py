"""A bare HTTP/1.1 server for the simulated fleet: keep-alive, Content-Length bodies, nothing else.

Why not the local engine's h11 server: the fleet must answer tens of thousands of samples per
second for 64 engines from one process on a small machine, so that the controller, not the
stand-in, is what a benchmark measures. This one parses a request head with one `split`, reads
the body by its Content-Length and writes the answer as one buffer.

Guarantees: binds 127.0.0.1; a head over 16 KiB, a chunked body or a body over 64 MiB is
answered 400/411/413 and the connection closed; a head must arrive within `head_timeout_s` of
the previous answer (idle keep-alive), a body within `head_timeout_s` of its head.
Not covered: pipelining, chunked bodies, HTTP/2, TLS — httpx sends none of them here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

# (method, path, body) -> (status, content type, answer bytes)
Handler = Callable[[str, str, bytes], Awaitable[tuple[int, str, bytes]]]

MAX_HEAD = 16 * 1024
MAX_BODY = 64 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 408: "Request Timeout",
            411: "Length Required", 413: "Content Too Large", 500: "Internal Server Error"}  # fmt: skip


def _answer(status: int, kind: str, body: bytes, close: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\ncontent-type: {kind}\r\n"
        f"content-length: {len(body)}\r\nconnection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    return head.encode() + body


async def _serve_connection(stream: trio.SocketStream, handler: Handler, head_timeout_s: float
                            ) -> None:  # fmt: skip
    buffer = b""
    try:
        while True:
            with trio.move_on_after(head_timeout_s):
                while b"\r\n\r\n" not in buffer:
                    if len(buffer) > MAX_HEAD:
                        await stream.send_all(_answer(400, "text/plain", b"head too large", True))
                        return
                    chunk = await stream.receive_some(256 * 1024)
                    if not chunk:
                        return  # the client closed an idle connection
                    buffer += chunk
            if b"\r\n\r\n" not in buffer:
                return  # idle past the keep-alive bound
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in lines[1:])}  # fmt: skip
            if "chunked" in headers.get("transfer-encoding", ""):
                await stream.send_all(
                    _answer(411, "text/plain", b"chunked bodies unsupported", True)
                )
                return
            length = int(headers.get("content-length", "0"))
            if length > MAX_BODY:
                await stream.send_all(_answer(413, "text/plain", b"body too large", True))
                return
            with trio.move_on_after(head_timeout_s):
                while len(buffer) < length:
                    chunk = await stream.receive_some(max(length - len(buffer), 64 * 1024))
                    if not chunk:
                        return
                    buffer += chunk
            if len(buffer) < length:
                await stream.send_all(_answer(408, "text/plain", b"body too slow", True))
                return
            body, buffer = buffer[:length], buffer[length:]
            try:
                status, kind, answer = await handler(method, target.split("?", 1)[0], body)
            except Exception as exc:  # a handler bug is an answer, never a dead server
                status, kind, answer = 500, "text/plain", repr(exc).encode()
            await stream.send_all(_answer(status, kind, answer))
    except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
        return  # client gone, or a head we cannot read
    finally:
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            await stream.aclose()


async def serve_bare_http(handler: Handler, *, port: int = 0, head_timeout_s: float = 120.0,
                          task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                          ) -> None:  # fmt: skip
    """Serve `handler` on 127.0.0.1:`port` until cancelled; `task_status.started(url)` once bound."""
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    host, bound = listeners[0].socket.getsockname()[:2]

    async def handle(stream: trio.SocketStream) -> None:
        await _serve_connection(stream, handler, head_timeout_s)

    task_status.started(f"http://{host}:{bound}")
    await trio.serve_listeners(handle, listeners)
