"""The agent proxy: an OpenAI-compatible server whose calls become exact token trajectories.

`open_agent_proxy(chat)` serves on 127.0.0.1 (a free port) for as long as its `async with`
lasts; `proxy.open_session(ctx, index)` gives one session its own base URL
(`{url}/sessions/<id>/v1`) and API key. A session's `POST /chat/completions` renders the
messages (or extends a branch, `rollouts.agent.trajectory`), sends the token ids to
`ctx.engine.generate` (the engine pool: failover, staleness and weight versions apply), reads
tool calls with the configured parser and answers in OpenAI's shapes, streamed (SSE) when
asked, with the call's token ids when asked (`return_token_ids`, as vLLM answers it). `GET /models` lists the one model.

Guarantees:
- a request needs its session's key (`Authorization: Bearer <key>`), checked on the headers
  before the body is read: 401 otherwise, 404 for a session that is not open, so one harness
  cannot write into another's session;
- a bad body is answered 400 with OpenAI's error object naming the field, and recorded as
  the session's `fault` (its sample fails), and so are a body over the size limit (413) and
  the engine's own 4xx (a prompt past the context: answered with the engine's status and text);
  any other engine error is answered 502 and kept in `engine_error` (the rollout re-raises it,
  so the pool's failure policy applies); a request
  aborted at the engine (surplus, pause) is answered 503 and marks the session aborted;
- every engine request holds a `ctx.limiter` token and is listed in `ctx.in_flight`
  (`rollouts.multiturn.generate_turn`); the session's limits (`SessionLimits`) bound calls
  and response tokens: past them a call is answered 400 and the session is `truncated`.

Not covered: `n > 1`, forced tool choice, token-by-token streaming (the answer is sampled
whole, then sent as SSE chunks), images and audio.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
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
from rollouts.agent.openai_shapes import (
    AgentRequestError,
    answer_from_text,
    chat_completion,
    completion_chunks,
    error_body,
    model_list,
    read_chat_request,
)
from rollouts.agent.trajectory import SessionTrajectory
from rollouts.chat_turns import ChatTurns
from rollouts.generate_fn import GenerateContext
from rollouts.multiturn import generate_turn
from rollouts.request_ids import oldest_version, request_rid, version_number
from rollouts.tools.base import ToolParser
from rollouts.tools.parsers import parse_hermes_tool_calls

_PATH = re.compile(r"^/sessions/([A-Za-z0-9_-]+)/v1/(chat/completions|models)$")


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


def _error(status: int, message: str, *, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None) -> Response:  # fmt: skip
    return json_response(error_body(message, kind=kind, param=param, code=code), status)


class _ProxyApp(App):
    """The local engine's ASGI layer with per-session routes and keys."""

    def __init__(self, proxy: AgentProxy) -> None:
        super().__init__()
        self.proxy = proxy
        self.chat_route = Route(("POST",), proxy.chat_completions, cancel_on_disconnect=True)
        self.models_route = Route(("GET",), proxy.models)

    def _find(self, path: str) -> tuple[Route | None, dict[str, str]]:
        match = _PATH.match(path)
        if match is None:
            return None, {}
        route = self.chat_route if match.group(2) == "chat/completions" else self.models_route
        return route, {"session": match.group(1)}

    def _refuse_on_headers(self, request: Request) -> Response | None:
        route, params = self._find(request.path)
        if route is None:
            return _error(404, f"no route {request.path}: use /sessions/<id>/v1/chat/completions")
        if request.method not in route.methods:
            return _error(405, f"{request.method} is not allowed on {request.path}")
        session = self.proxy.sessions.get(params["session"])
        if session is None or session.closed:
            return _error(404, f"session {params['session']!r} is not open", code="no_session")
        if not self.authorized(request, session.api_key):
            return _error(401, "incorrect API key for this session", code="invalid_api_key")
        request.path_params = params
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            message = f"request body over {self.max_body_bytes} bytes ({length})"
            session.fault = session.fault or f"refused (HTTP 413): {message}"
            return _error(413, message)
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

    async def chat_completions(self, request: Request) -> Response | StreamingResponse:
        session = self.sessions[request.path_params["session"]]
        try:
            req = read_chat_request(request.json())
        except ValueError as exc:  # AgentRequestError, or the body is not JSON
            param = exc.param if isinstance(exc, AgentRequestError) else None
            session.fault = session.fault or f"bad request body: {exc}"
            return _error(400, str(exc), param=param)
        limits = session.limits
        if session.n_calls >= limits.max_calls:
            session.truncated = True
            return _error(400, f"this session allows {limits.max_calls} calls",
                          code="max_calls_exceeded")  # fmt: skip
        plan = session.trajectory.plan(req.messages, req.tools)
        params = dict(session.ctx.sampling_params)
        cap = [int(params["max_new_tokens"])] if "max_new_tokens" in params else []
        if req.max_tokens is not None:
            cap.append(req.max_tokens)
        if limits.max_response_tokens is not None:
            cap.append(limits.max_response_tokens - session.trajectory.response_len(plan))
        if cap:
            if min(cap) < 1:
                session.truncated = True
                return _error(400, "the session's response-token budget is spent",
                              code="context_length_exceeded")  # fmt: skip
            params["max_new_tokens"] = min(cap)
            if "min_new_tokens" in params:
                params["min_new_tokens"] = min(int(params["min_new_tokens"]), min(cap))
        if req.stop:
            params["stop"] = [*(params.get("stop") or []), *req.stop]
        rid = request_rid(session.ctx.rid_prefix, session.index, f"c{session.n_calls}")
        session.n_calls += 1
        try:
            result = await generate_turn(session.ctx, plan.input_ids, params, rid)
        except EngineError as exc:
            if exc.status is not None and 400 <= exc.status < 500:  # the agent's request: a fault
                session.fault = session.fault or f"the engine refused call {session.n_calls}: {exc}"
                return _error(exc.status, f"the engine refused the request: {exc}")
            session.engine_error = session.engine_error or exc
            return _error(502, f"the engine failed: {exc}", kind="server_error")
        finish = result.finish_reason.type
        if finish == "abort":
            session.aborted = True
            return _error(503, "the request was aborted at the engine", kind="server_error")
        text = self.chat.decode_turn(result.output_ids)
        answer = answer_from_text(text, finish, self.parser if req.parse_tools else None,
                                  f"call_{session.id}_{session.n_calls}")  # fmt: skip
        session.last_branch = session.trajectory.record(
            plan, req.messages, answer.message, result.output_ids, result.output_logprobs,
            _versions(result), finish, req.tools,
        )  # fmt: skip
        completion_id = f"chatcmpl-{session.id}-{session.n_calls}"
        # the trajectory's own ids: what the engine was sent and what it sampled
        ids = (plan.input_ids, result.output_ids) if req.return_token_ids else None
        if req.stream:
            chunks = completion_chunks(answer, completion_id=completion_id, model=req.model,
                                       token_ids=ids)  # fmt: skip
            return StreamingResponse(_sse(chunks))
        return json_response(chat_completion(
            answer, completion_id=completion_id, model=req.model,
            prompt_tokens=len(plan.input_ids), completion_tokens=len(result.output_ids),
            token_ids=ids,
        ))  # fmt: skip


def _versions(result: Any) -> list[tuple[int, int, int]]:
    """(start, end, weight version) spans over a result's output ids."""
    spans = [(s.start, s.end, version_number(s.version, 0))
             for s in getattr(result, "weight_versions", ()) or () if s.end > s.start]  # fmt: skip
    return spans or [(0, len(result.output_ids), oldest_version(result))]


async def _sse(chunks: list[Mapping[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield sse_event(chunk)
    yield SSE_DONE


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
