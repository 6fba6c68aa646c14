"""One model turn of an agent session, whatever dialect asked for it: the proxy's core.

`sample_turn(session, req, chat, parser)` takes a call already translated to chat messages +
tools (`openai_shapes.ChatRequest`, from any of the proxy's dialects), applies the session's
limits, plans its token ids (`rollouts.agent.trajectory`: extend a branch or start one),
samples at `session.ctx.engine` under the rollout's limiter, reads the answer's tool calls and
records the sampled tokens on the branch. Each dialect answers with the `Turn` in its own
shapes; a refusal is an `AgentRequestError` whose status, kind and code it renders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engines.types import FinishReason
from plumbing.errors import EngineError
from rollouts.agent.openai_shapes import AgentRequestError, Answer, ChatRequest, answer_from_text
from rollouts.chat_turns import ChatTurns
from rollouts.multiturn import generate_turn
from rollouts.request_ids import oldest_version, request_rid, version_number
from rollouts.tools.base import ToolParser

if TYPE_CHECKING:
    from rollouts.agent.proxy import AgentSession


@dataclass(frozen=True)
class Turn:
    """One sampled turn, for a dialect to answer with."""

    answer: Answer
    finish: FinishReason  # the engine's (`matched`: the stop string or token hit)
    prompt_ids: tuple[int, ...]  # the request's ids (the branch so far + appended turns)
    output_ids: tuple[int, ...]  # the engine's sampled ids
    call: int  # the session's call number (1, 2, ...)


async def sample_turn(session: AgentSession, req: ChatRequest, chat: ChatTurns,
                      parser: ToolParser) -> Turn:  # fmt: skip
    """One model turn for a call of any dialect: limits, engine request, trajectory.

    Raises:
        AgentRequestError: the call is refused; its status, kind and code say why (a fault,
            truncation, abort or engine error is also recorded on the session).
    """
    limits = session.limits
    if session.n_calls >= limits.max_calls:
        session.truncated = True
        raise AgentRequestError(f"this session allows {limits.max_calls} calls",
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
            raise AgentRequestError("the session's response-token budget is spent",
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
            raise AgentRequestError(f"the engine refused the request: {exc}",
                                    status=exc.status) from exc  # fmt: skip
        session.engine_error = session.engine_error or exc
        raise AgentRequestError(f"the engine failed: {exc}", status=502,
                                kind="server_error") from exc  # fmt: skip
    finish = result.finish_reason.type
    if finish == "abort":
        session.aborted = True
        raise AgentRequestError("the request was aborted at the engine", status=503,
                                kind="server_error")  # fmt: skip
    text = chat.decode_turn(result.output_ids)
    answer = answer_from_text(text, finish, parser if req.parse_tools else None,
                              f"call_{session.id}_{session.n_calls}")  # fmt: skip
    session.last_branch = session.trajectory.record(
        plan, req.messages, answer.message, result.output_ids, result.output_logprobs,
        _versions(result), finish, req.tools,
    )  # fmt: skip
    return Turn(answer, result.finish_reason, tuple(plan.input_ids), tuple(result.output_ids),
                session.n_calls)  # fmt: skip


def _versions(result: Any) -> list[tuple[int, int, int]]:
    """(start, end, weight version) spans over a result's output ids."""
    spans = [(s.start, s.end, version_number(s.version, 0))
             for s in getattr(result, "weight_versions", ()) or () if s.end > s.start]  # fmt: skip
    return spans or [(0, len(result.output_ids), oldest_version(result))]
