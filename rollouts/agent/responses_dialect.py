"""OpenAI Responses shapes for the agent proxy: `POST /v1/responses` to chat messages and back.

Pure (no HTTP, no engine), like `openai_shapes`: `read_responses_request` turns a Responses
body into the `ChatRequest` the proxy samples (the chat template renders it: the trajectory
rules of `rollouts.agent.trajectory` apply unchanged), naming the offending field in an
`AgentRequestError`; `response_object` / `response_events` answer in the shapes the `openai`
client parses (errors: `openai_shapes.error_body`).

Translation:
- `instructions` is the first message, role "system" (as OpenAI's, not carried over from a
  previous response);
- `input` is a string (one user message) or items: messages (role user, system, developer or
  assistant; content a string or `input_text` / `output_text` parts), `function_call` items
  (tool calls of the assistant message before them, or of a new one) and
  `function_call_output` items (a "tool" message for a `call_id` of an earlier function call);
- `previous_response_id` puts that response's conversation (its input and output) before
  `input`; the proxy keeps each session's responses (unless `store: false`), and an id it does
  not hold for this session (unknown, or another session's) is refused;
- `tools` of type function (name, description, parameters) are the chat template's specs.
The answer comes back as a `message` item with one `output_text` part (the content, if any)
and a `function_call` item per call the parser read; `status` is "incomplete" (with
`incomplete_details.reason` "max_output_tokens") when the turn hit its token cap.

Refused (400): images, files, audio, reasoning and other item types, built-in tools
(web_search, file_search, ...), `tool_choice` required or a named function, and a `text.format`
other than plain text. `temperature`, `top_p`, `reasoning`, `parallel_tool_calls`, `truncation`
and `metadata` are accepted and ignored (the rollout's sampling decides).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollouts.agent.openai_shapes import AgentRequestError, Answer, ChatRequest

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")

History = tuple[dict[str, Any], ...]  # a stored response's conversation, instructions aside


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ChatRequest  # the whole conversation, as the chat template renders it
    history: History  # the same without the instructions: stored with the answer
    instructions: str | None
    previous_response_id: str | None
    store: bool


def _fail(message: str, where: str, *, code: str | None = None) -> AgentRequestError:
    return AgentRequestError(f"{where}: {message}", param=where, code=code)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail("must be a string or a list of text parts", f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):  # fmt: skip
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise _fail(f"only input_text / output_text parts are supported, got {kind!r}",
                        f"{where}.content[{j}]")  # fmt: skip
        parts.append(part["text"])
    return "".join(parts)


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
        raise _fail("a function_call needs string `call_id`, `name` and `arguments`", where)
    try:
        parsed = json.loads(args or "{}")
    except json.JSONDecodeError as exc:
        raise _fail(f"is not JSON ({exc})", f"{where}.arguments") from exc
    if not isinstance(parsed, Mapping):
        raise _fail("must be a JSON object", f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def _items(raw: Any, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages appended to `history` (a copy is returned)."""
    out = [dict(m) for m in history]
    if isinstance(raw, str):
        return [*out, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _fail("must be a string or a non-empty list of items", "input")
    known = {c["id"] for m in out for c in m.get("tool_calls") or ()}
    open_turn = False  # the last message is an assistant turn of this input (calls join it)
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _fail("must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise _fail(f"role must be one of {list(_ROLES)}, got {item.get('role')!r}",
                            f"{where}.role")  # fmt: skip
            out.append({"role": role, "content": _text(item.get("content"), where)})
            open_turn = role == "assistant"
        elif kind == "function_call":
            call = _function_call(item, where)
            known.add(call["id"])
            if not open_turn:
                out.append({"role": "assistant", "content": None})
                open_turn = True
            out[-1] = {**out[-1], "tool_calls": [*(out[-1].get("tool_calls") or ()), call]}
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known:
                raise _fail(f"call_id {call_id!r} names no function_call before it",
                            f"{where}.call_id")  # fmt: skip
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            open_turn = False
        else:
            raise _fail(f"item type {kind!r} is not supported (message, function_call and "
                        "function_call_output are)", f"{where}.type")  # fmt: skip
    return out


def _tools(raw: Any) -> tuple[dict[str, Any], ...] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise _fail("must be a list of tools", "tools")
    out = []
    for j, tool in enumerate(raw):
        if not isinstance(tool, Mapping) or tool.get("type") != "function" \
                or not isinstance(tool.get("name"), str):  # fmt: skip
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise _fail(f"only function tools with a name are supported, got type {kind!r}",
                        f"tools[{j}]")  # fmt: skip
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": str(tool.get("description") or ""),
            "parameters": dict(tool.get("parameters") or {})}})  # fmt: skip
    return tuple(out)


def read_responses_request(body: Any, previous: Callable[[str], Sequence[Mapping[str, Any]] | None]
                           ) -> ResponsesRequest:  # fmt: skip
    """Check a `/v1/responses` body and translate it (module docstring); `previous(id)` is the
    stored conversation of one of this session's responses, or None.

    Raises:
        AgentRequestError: names the field (e.g. `input[3].call_id`).
    """
    if not isinstance(body, Mapping):
        raise AgentRequestError("the request body must be a JSON object")
    prev_id = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    if prev_id is not None:
        stored = previous(prev_id) if isinstance(prev_id, str) else None
        if stored is None:
            raise _fail(f"response {prev_id!r} is not one of this session's stored responses (an "
                        "id is valid only in the session that made it, and not with store: "
                        "false)", "previous_response_id", code="previous_response_not_found")  # fmt: skip
        history = [dict(m) for m in stored]
    conversation = _items(body.get("input"), history)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _fail("must be a string", "instructions")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise _fail(f"tool_choice {choice!r} is not supported: the proxy samples freely, so only "
                    '"auto" and "none" can be honoured', "tool_choice")  # fmt: skip
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") != "text"):
        raise _fail("only the text format is supported", "text.format")
    cap = body.get("max_output_tokens")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise _fail(f"must be a positive integer, got {cap!r}", "max_output_tokens")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat = ChatRequest(tuple(system + conversation), _tools(body.get("tools")), choice != "none",
                       bool(body.get("stream", False)), cap, (),
                       str(body.get("model") or "policy"))  # fmt: skip
    return ResponsesRequest(chat, tuple(conversation), instructions, prev_id,
                            body.get("store", True) is not False)  # fmt: skip


def output_items(answer: Answer, response_id: str) -> list[dict[str, Any]]:
    """The answer as output items: a message (its content, if any), then its function calls."""
    key = response_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if answer.message.get("content"):
        items.append({"type": "message", "id": f"msg_{key}", "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": answer.message["content"],
                                   "annotations": [], "logprobs": []}]})  # fmt: skip
    for j, call in enumerate(answer.message.get("tool_calls") or ()):
        items.append({"type": "function_call", "id": f"fc_{key}_{j}", "call_id": call["id"],
                      "name": call["function"]["name"], "status": "completed",
                      "arguments": json.dumps(call["function"]["arguments"])})  # fmt: skip
    return items


def response_object(answer: Answer, *, response_id: str, request: ResponsesRequest,
                    input_tokens: int, output_tokens: int,
                    in_progress: bool = False) -> dict[str, Any]:  # fmt: skip
    """The `response` object (`in_progress`: the head of a stream, without output)."""
    incomplete = answer.finish_reason == "length"
    status = "in_progress" if in_progress else ("incomplete" if incomplete else "completed")
    tools = [{"type": "function", **t["function"]} for t in request.chat.tools or ()]
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "model": request.chat.model,
        "output": [] if in_progress else output_items(answer, response_id),
        "parallel_tool_calls": True, "previous_response_id": request.previous_response_id,
        "tool_choice": "auto" if request.chat.parse_tools else "none", "tools": tools,
        "store": request.store, "metadata": {},
        "usage": None if in_progress else {
            "input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }  # fmt: skip


def response_events(answer: Answer, *, response_id: str, request: ResponsesRequest,
                    input_tokens: int, output_tokens: int) -> list[tuple[str, dict[str, Any]]]:  # fmt: skip
    """The (event, data) pairs of a streamed response: response.created / in_progress, per item
    output_item.added, its text (content_part, output_text delta / done) or arguments
    (function_call_arguments delta / done), output_item.done, then response.completed (or
    response.incomplete); the answer is sampled whole, then sent as these events."""
    full = response_object(answer, response_id=response_id, request=request,
                           input_tokens=input_tokens, output_tokens=output_tokens)  # fmt: skip
    head = response_object(answer, response_id=response_id, request=request, input_tokens=0,
                           output_tokens=0, in_progress=True)  # fmt: skip
    events: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **data}))

    emit("response.created", response=head)
    emit("response.in_progress", response=head)
    for index, item in enumerate(full["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "content": []})  # fmt: skip
            emit("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            emit("response.output_text.delta", **at, content_index=0, delta=part["text"],
                 logprobs=[])  # fmt: skip
            emit("response.output_text.done", **at, content_index=0, text=part["text"],
                 logprobs=[])  # fmt: skip
            emit("response.content_part.done", **at, content_index=0, part=part)
        else:
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "arguments": ""})  # fmt: skip
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, name=item["name"],
                 arguments=item["arguments"])  # fmt: skip
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.incomplete" if full["status"] == "incomplete" else "response.completed",
         response=full)  # fmt: skip
    return events
