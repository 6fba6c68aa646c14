"""The agent proxy: an OpenAI- and Anthropic-compatible server whose calls become exact tokens.

`open_agent_proxy(chat)` serves on 127.0.0.1 (a free port) for as long as its `async with`
lasts; `proxy.open_session(ctx, index)` gives one session its own base URL
(`{url}/sessions/<id>/v1`) and API key. A session speaks three dialects, each translated to
chat messages + tools (`openai_shapes`, `anthropic_dialect`, `responses_dialect`) and sampled
by one core (`AgentProxy.sample_turn`): it renders the messages (or extends a branch,
`rollouts.agent.trajectory`), sends the token ids to `ctx.engine.generate` (the engine pool:
failover, staleness and weight versions apply) and reads tool calls with the configured
parser. `POST /chat/completions` (OpenAI chat), `POST /responses` (OpenAI Responses, with
`previous_response_id` among the session's own responses) and `POST /messages` (Anthropic
Messages: the anthropic client appends `/v1/messages` to `{url}/sessions/<id>`) answer in
their API's shapes, streamed (SSE) when asked; chat completions with the call's token ids
when asked (`return_token_ids`, as vLLM answers it). `GET /models` lists the one model.

Guarantees:
- a request needs its session's key (`Authorization: Bearer <key>` or `x-api-key: <key>`),
  checked on the headers before the body is read: 401 otherwise, 404 for a session that is not
  open, so one harness cannot write into another's session;
- a bad body is answered 400 with the dialect's error object naming the field, and recorded as
  the session's `fault` (its sample fails), and so are a body over the size limit (413) and
  the engine's own 4xx (a prompt past the context: answered with the engine's status and text);
  any other engine error is answered 502 and kept in `engine_error` (the rollout re-raises it,
  so the pool's failure policy applies); a request
  aborted at the engine (surplus, pause) is answered 503 and marks the session aborted;
- every engine request holds a `ctx.limiter` token and is listed in `ctx.in_flight`
  (`rollouts.multiturn.generate_turn`); the session's limits (`SessionLimits`) bound calls
  and response tokens: past them a call is answered 400 and the session is `truncated`.

Not covered: `n > 1`, forced tool choice, token-by-token streaming (the answer is sampled
whole, then sent as SSE chunks or events), images and audio.
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from engines.local.asgi import (
    SSE_DONE,
    App,
    Request,
    Response,
    Route,
    StreamingResponse,
    json_response,
    sse_event,
)
from engines.local.http11 import ConnectionLimits, serve_http
from plumbing.errors import EngineError
from rollouts.agent.anthropic_dialect import (
    anthropic_error,
    message_events,
    message_object,
    read_messages_request,
    stop_reason,
)
from rollouts.agent.openai_shapes import (
    AgentRequestError,
    chat_completion,
    completion_chunks,
    error_body,
    model_list,
    read_chat_request,
)
from rollouts.agent.responses_dialect import (
    History,
    read_responses_request,
    response_events,
    response_object,
)
from rollouts.agent.trajectory import SessionTrajectory
from rollouts.agent.turns import sample_turn
from rollouts.chat_turns import ChatTurns
from rollouts.generate_fn import GenerateContext
from rollouts.tools.base import ToolParser
from rollouts.tools.parsers import parse_hermes_tool_calls

_PATH = re.compile(r"^/sessions/([A-Za-z0-9_-]+)/v1/(chat/completions|models|messages|responses)$")


@dataclass(frozen=True)
class SessionLimits:
    """Bounds of one session. `max_response_tokens`: all tokens after a branch's prompt."""

    max_calls: int = 32
    max_response_tokens: int | None = None


@dataclass
class AgentSession:
    """One agent's session: its URL, key, engine context and what its calls produced."""

    id: str
    api_key: str
    base_url: str
    ctx: GenerateContext
    index: int
    trajectory: SessionTrajectory
    limits: SessionLimits
    n_calls: int = 0
    fault: str | None = None  # the first bad request, as its error text
    engine_error: EngineError | None = None
    aborted: bool = False
    truncated: bool = False
    closed: bool = False
    last_branch: int | None = None  # the branch the latest call went to
    responses: dict[str, History] = field(default_factory=dict)  # Responses API: id -> history


def _openai_error(exc: AgentRequestError) -> Response:
    body = error_body(str(exc), kind=exc.kind, param=exc.param, code=exc.code)
    return json_response(body, exc.status)


def _anthropic_error(exc: AgentRequestError) -> Response:
    return json_response(anthropic_error(exc.status, str(exc)), exc.status)


def _error(status: int, message: str, *, path: str = "", kind: str = "invalid_request_error",
           code: str | None = None) -> Response:  # fmt: skip
    """An error in the shape of the dialect `path` is for (Anthropic's for `/messages`)."""
    exc = AgentRequestError(message, status=status, kind=kind, code=code)
    return (_anthropic_error if path.endswith("/messages") else _openai_error)(exc)


class _ProxyApp(App):
    """The local engine's ASGI layer with per-session routes and keys."""

    def __init__(self, proxy: AgentProxy) -> None:
        super().__init__()
        self.proxy = proxy
        post = partial(Route, ("POST",), cancel_on_disconnect=True)
        self.routes = {"chat/completions": post(proxy.chat_completions),
                       "messages": post(proxy.messages), "responses": post(proxy.responses),
                       "models": Route(("GET",), proxy.models)}  # fmt: skip

    def _find(self, path: str) -> tuple[Route | None, dict[str, str]]:
        match = _PATH.match(path)
        if match is None:
            return None, {}
        return self.routes[match.group(2)], {"session": match.group(1)}

    def _refuse_on_headers(self, request: Request) -> Response | None:
        route, params = self._find(request.path)
        path = request.path
        if route is None:
            hint = (" (the anthropic client appends /v1/messages itself: give it the session URL "
                    "without /v1, AgentEndpoint.anthropic_base_url)"
                    if path.endswith("/v1/v1/messages") else "")  # fmt: skip
            return _error(404, f"no route {path}: use /sessions/<id>/v1/chat/completions, "
                          f"/v1/responses or /v1/messages{hint}", path=path)  # fmt: skip
        if request.method not in route.methods:
            return _error(405, f"{request.method} is not allowed on {path}", path=path)
        session = self.proxy.sessions.get(params["session"])
        if session is None or session.closed:
            return _error(404, f"session {params['session']!r} is not open", path=path,
                          code="no_session")  # fmt: skip
        given = request.headers.get("x-api-key", "")
        if not (self.authorized(request, session.api_key)
                or hmac.compare_digest(given.encode(), session.api_key.encode())):  # fmt: skip
            return _error(401, "incorrect API key for this session", path=path,
                          code="invalid_api_key")  # fmt: skip
        request.path_params = params
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            message = f"request body over {self.max_body_bytes} bytes ({length})"
            session.fault = session.fault or f"refused (HTTP 413): {message}"
            return _error(413, message, path=path)
        return None


class AgentProxy:
    """Sessions and their chat-completions handler (serve with `open_agent_proxy`)."""

    def __init__(self, chat: ChatTurns, *, parser: ToolParser = parse_hermes_tool_calls,
                 model_name: str = "policy") -> None:  # fmt: skip
        self.chat = chat
        self.parser = parser
        self.model_name = model_name
        self.sessions: dict[str, AgentSession] = {}
        self.url = ""
        self.app = _ProxyApp(self)

    def open_session(self, ctx: GenerateContext, index: int = 0,
                     limits: SessionLimits = SessionLimits()) -> AgentSession:  # fmt: skip
        """A new session sampling with `ctx` (its rids: `{ctx.rid_prefix}-{index}-c{call}`)."""
        sid = secrets.token_hex(8)
        session = AgentSession(sid, f"sk-session-{secrets.token_hex(16)}",
                               f"{self.url}/sessions/{sid}/v1", ctx, index,
                               SessionTrajectory(self.chat), limits)  # fmt: skip
        self.sessions[sid] = session
        return session

    def close_session(self, session: AgentSession) -> None:
        """Refuse the session's later calls (404) and forget it."""
        session.closed = True
        self.sessions.pop(session.id, None)

    async def models(self, request: Request) -> Response:
        return json_response(model_list([self.model_name]))

    def _session(self, request: Request) -> AgentSession | Response:
        """The call's session, or its 404: the headers' check found it open, but it may have
        been closed (its harness timed out) while the body was read."""
        sid = request.path_params["session"]
        session = self.sessions.get(sid)
        if session is None:
            return _error(404, f"session {sid!r} is not open", path=request.path,
                          code="no_session")  # fmt: skip
        return session

    @staticmethod
    def _bad_body(session: AgentSession, exc: ValueError) -> AgentRequestError:
        """A body that could not be read (not JSON, or a dialect's check): the session's fault."""
        session.fault = session.fault or f"bad request body: {exc}"
        return exc if isinstance(exc, AgentRequestError) else AgentRequestError(str(exc))

    async def chat_completions(self, request: Request) -> Response | StreamingResponse:
        session = self._session(request)
        if isinstance(session, Response):
            return session
        try:
            req = read_chat_request(request.json())
        except ValueError as exc:  # AgentRequestError, or the body is not JSON
            return _openai_error(self._bad_body(session, exc))
        try:
            turn = await sample_turn(session, req, self.chat, self.parser)
        except AgentRequestError as exc:
            return _openai_error(exc)
        completion_id = f"chatcmpl-{session.id}-{turn.call}"
        # the trajectory's own ids: what the engine was sent and what it sampled
        ids = (turn.prompt_ids, turn.output_ids) if req.return_token_ids else None
        if req.stream:
            chunks = completion_chunks(turn.answer, completion_id=completion_id, model=req.model,
                                       token_ids=ids)  # fmt: skip
            return StreamingResponse(_sse(chunks))
        return json_response(chat_completion(
            turn.answer, completion_id=completion_id, model=req.model,
            prompt_tokens=len(turn.prompt_ids), completion_tokens=len(turn.output_ids),
            token_ids=ids,
        ))  # fmt: skip

    async def messages(self, request: Request) -> Response | StreamingResponse:
        """Anthropic's `POST /v1/messages` (`rollouts.agent.anthropic_dialect`)."""
        session = self._session(request)
        if isinstance(session, Response):
            return session
        try:
            req = read_messages_request(request.json())
        except ValueError as exc:
            return _anthropic_error(self._bad_body(session, exc))
        try:
            turn = await sample_turn(session, req, self.chat, self.parser)
        except AgentRequestError as exc:
            return _anthropic_error(exc)
        shape = {"message_id": f"msg_{session.id}_{turn.call}", "model": req.model,
                 "stop": stop_reason(turn.answer, turn.finish.matched, req.stop),
                 "input_tokens": len(turn.prompt_ids), "output_tokens": len(turn.output_ids)}  # fmt: skip
        if req.stream:
            return StreamingResponse(_named_sse(message_events(turn.answer, **shape)))
        return json_response(message_object(turn.answer, **shape))

    async def responses(self, request: Request) -> Response | StreamingResponse:
        """OpenAI's `POST /v1/responses` (`rollouts.agent.responses_dialect`)."""
        session = self._session(request)
        if isinstance(session, Response):
            return session
        try:
            req = read_responses_request(request.json(), session.responses.get)
        except ValueError as exc:
            return _openai_error(self._bad_body(session, exc))
        try:
            turn = await sample_turn(session, req.chat, self.chat, self.parser)
        except AgentRequestError as exc:
            return _openai_error(exc)
        response_id = f"resp_{secrets.token_hex(12)}"
        if req.store:
            session.responses[response_id] = (*req.history, turn.answer.message)
        shape = {"response_id": response_id, "request": req, "input_tokens": len(turn.prompt_ids),
                 "output_tokens": len(turn.output_ids)}  # fmt: skip
        if req.chat.stream:
            return StreamingResponse(_named_sse(response_events(turn.answer, **shape)))
        return json_response(response_object(turn.answer, **shape))


async def _sse(chunks: list[Mapping[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield sse_event(chunk)
    yield SSE_DONE


async def _named_sse(events: list[tuple[str, Mapping[str, Any]]]) -> AsyncIterator[bytes]:
    """Server-sent events with an `event:` line each (Anthropic's and the Responses API's)."""
    for name, data in events:
        yield b"event: " + name.encode() + b"\n" + sse_event(data)


@asynccontextmanager
async def open_agent_proxy(
    chat: ChatTurns,
    *,
    parser: ToolParser = parse_hermes_tool_calls,
    model_name: str = "policy",
    port: int = 0,
    limits: ConnectionLimits | None = None,
) -> AsyncIterator[AgentProxy]:
    """Serve an `AgentProxy` on 127.0.0.1 (`port` 0: a free one) until the block exits.

    The server runs in a nursery of its own, cancelled on exit: the proxy never outlives the
    block, and a harness still calling afterwards gets a refused connection.
    """
    proxy = AgentProxy(chat, parser=parser, model_name=model_name)
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(partial(serve_http, proxy.app, "127.0.0.1", port,
                                                  limits or ConnectionLimits()))  # fmt: skip
        proxy.url = urls[0]
        try:
            yield proxy
        finally:
            for session in list(proxy.sessions.values()):
                proxy.close_session(session)
            nursery.cancel_scope.cancel()
