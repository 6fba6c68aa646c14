"""Anthropic Messages shapes for the agent proxy: `POST /v1/messages` to chat messages and back.

Pure (no HTTP, no engine), like `openai_shapes`: `read_messages_request` turns a Messages body
into the `ChatRequest` the proxy samples (the chat template renders it: the trajectory rules of
`rollouts.agent.trajectory` apply unchanged), naming the offending field in an
`AgentRequestError`; `message_object` / `message_events` / `anthropic_error` answer in the
shapes the `anthropic` client parses.

Translation:
- `system` (a string or text blocks) is the first message, role "system";
- a user message's text blocks are one user message; each `tool_result` block is a "tool"
  message for its `tool_use_id` (which must name a `tool_use` of an earlier assistant message),
  its content a string or text blocks; `is_error: true` is shown to the model as a result
  starting with "Error: " (as the project's own tools report failures);
- an assistant message's text blocks are its content, its `tool_use` blocks its tool calls;
- `tools` (name, description, input_schema) are the chat template's function specs.
The answer comes back as a `text` block (the content, if any) and a `tool_use` block per call
the parser read; `stop_reason` is `tool_use`, `max_tokens`, `stop_sequence` (a stop string of
the request was hit) or `end_turn`.

Refused (400, `invalid_request_error`): images, documents and thinking blocks, server tools
(no `input_schema`), `tool_choice` any / tool (the proxy samples freely), and an assistant
message last (prefill). `temperature`, `top_p`, `top_k` are accepted and ignored (the
rollout's sampling decides, as in `openai_shapes`); `max_tokens` is required, as Anthropic's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rollouts.agent.openai_shapes import AgentRequestError, Answer, ChatRequest

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def _fail(message: str, where: str) -> AgentRequestError:
    return AgentRequestError(f"{where}: {message}", param=where)


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, Mapping) for b in content):
        raise _fail("must be a string or a list of content blocks", f"{where}.content")
    return content


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _fail("a text block needs a string `text`", f"{where}.text")
    return text


def _texts(content: Any, where: str) -> str:
    """Text blocks (or a string) as one string; any other block is refused."""
    if content is None:
        return ""
    parts = []
    for j, block in enumerate(_blocks(content, where)):
        if block.get("type") != "text":
            raise _fail(f"only text blocks are supported here, got {block.get('type')!r}",
                        f"{where}.content[{j}]")  # fmt: skip
        parts.append(_text(block, f"{where}.content[{j}]"))
    return "\n".join(parts)


def _user(content: Any, where: str, known_ids: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(_blocks(content, where)):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            if texts:  # text before a result: its own user turn, in order
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(block, at, known_ids))
        else:
            raise _fail(f"block type {kind!r} is not supported in a user message (text and "
                        "tool_result are)", f"{at}.type")  # fmt: skip
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result(block: Mapping[str, Any], at: str, known_ids: set[str]) -> dict[str, Any]:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str) or use_id not in known_ids:
        raise _fail(f"tool_use_id {use_id!r} names no tool_use block of an earlier assistant "
                    "message", f"{at}.tool_use_id")  # fmt: skip
    text = _texts(block.get("content"), at)
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _fail("must be true or false", f"{at}.is_error")
    if is_error and not text.lstrip().startswith("Error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": use_id, "content": text}


def _assistant(content: Any, where: str, known_ids: set[str]) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(_blocks(content, where)):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            use_id, name, args = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(use_id, str) or not isinstance(name, str):
                raise _fail("a tool_use block needs a string `id` and `name`", at)
            if not isinstance(args, Mapping):
                raise _fail("must be an object", f"{at}.input")
            known_ids.add(use_id)
            calls.append({"id": use_id, "type": "function",
                          "function": {"name": name, "arguments": dict(args)}})  # fmt: skip
        else:
            raise _fail(f"block type {kind!r} is not supported in an assistant message (text "
                        "and tool_use are)", f"{at}.type")  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(raw: Any) -> tuple[dict[str, Any], ...] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise _fail("must be a list of tools", "tools")
    out = []
    for j, tool in enumerate(raw):
        at = f"tools[{j}]"
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise _fail("a tool needs a string `name`", at)
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise _fail(f"tool {tool['name']!r} has no input_schema: server tools "
                        f"(type {tool.get('type')!r}) are not supported", at)  # fmt: skip
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": str(tool.get("description") or ""),
            "parameters": dict(schema)}})  # fmt: skip
    return tuple(out)


def read_messages_request(body: Any) -> ChatRequest:
    """Check a `/v1/messages` body and translate it to chat messages (module docstring).

    Raises:
        AgentRequestError: names the field (e.g. `messages[2].content[0].tool_use_id`).
    """
    if not isinstance(body, Mapping):
        raise AgentRequestError("the request body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _fail(f"must be a positive integer, got {max_tokens!r}", "max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _fail("must be a non-empty list", "messages")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _texts(system, "system") if not isinstance(system, str) else system
        messages.append({"role": "system", "content": text})
    known_ids: set[str] = set()
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        if role == "user":
            messages += _user(message.get("content"), where, known_ids)
        elif role == "assistant":
            messages.append(_assistant(message.get("content"), where, known_ids))
        else:
            raise _fail(f"role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
    if raw[-1].get("role") != "user":
        raise _fail("the last message must be a user message (assistant prefill is not "
                    "supported: the proxy samples a whole new turn)", f"messages[{len(raw) - 1}]")  # fmt: skip
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind not in ("auto", "none"):
        raise _fail(f"tool_choice {choice!r} is not supported: the proxy samples freely, so only "
                    '{"type": "auto"} and {"type": "none"} can be honoured', "tool_choice")  # fmt: skip
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _fail("must be a list of strings", "stop_sequences")
    return ChatRequest(tuple(messages), _tools(body.get("tools")), kind == "auto",
                       bool(body.get("stream", False)), max_tokens, tuple(stops),
                       str(body.get("model") or "policy"))  # fmt: skip


def stop_reason(answer: Answer, matched: Any, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a sampled answer."""
    if answer.finish_reason == "tool_calls":
        return "tool_use", None
    if answer.finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def content_blocks(answer: Answer) -> list[dict[str, Any]]:
    """The answer as content blocks: its text (if any), then a tool_use block per call."""
    message = answer.message
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": dict(call["function"]["arguments"])})  # fmt: skip
    return blocks or [{"type": "text", "text": ""}]


def message_object(answer: Answer, *, message_id: str, model: str,
                   stop: tuple[str | None, str | None], input_tokens: int,
                   output_tokens: int) -> dict[str, Any]:  # fmt: skip
    """The non-streaming `message` object."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(answer), "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}  # fmt: skip


def message_events(answer: Answer, *, message_id: str, model: str, stop: tuple[str, str | None],
                   input_tokens: int, output_tokens: int) -> list[tuple[str, dict[str, Any]]]:  # fmt: skip
    """The (event, data) pairs of a streamed answer, in Anthropic's order: message_start, per
    block content_block_start / delta (text_delta, input_json_delta) / stop, message_delta,
    message_stop (the answer is sampled whole, then sent as these events)."""
    head = message_object(answer, message_id=message_id, model=model, stop=(None, None),
                          input_tokens=input_tokens, output_tokens=0)  # fmt: skip
    out: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": {**head, "content": []}})
    ]
    for index, block in enumerate(content_blocks(answer)):
        start: dict[str, Any] = {"type": "text", "text": ""}
        delta: dict[str, Any] = {"type": "text_delta", "text": block.get("text")}
        if block["type"] == "tool_use":
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        out += [("content_block_start", {"type": "content_block_start", "index": index,
                                         "content_block": start}),
                ("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": delta}),
                ("content_block_stop", {"type": "content_block_stop", "index": index})]  # fmt: skip
    out.append(("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                  "usage": {"output_tokens": output_tokens}}))  # fmt: skip
    out.append(("message_stop", {"type": "message_stop"}))
    return out


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object (`anthropic.APIStatusError` reads `body["error"]["message"]`)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
