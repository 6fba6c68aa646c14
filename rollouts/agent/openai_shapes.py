"""OpenAI chat-completions shapes for the agent proxy: request checks, answers, SSE chunks, errors.

Pure (no HTTP, no engine): the proxy (`rollouts.agent.proxy`) reads a request body with
`read_chat_request`, which names the offending field in an `AgentRequestError`, and answers
with `chat_completion` / `completion_chunks` / `error_body`, the shapes the `openai` client
parses. Tool calls in the sampled text are read by the project's parsers
(`rollouts.tools.parsers`); a malformed call stays in the content as text (it cannot be
given to the agent as a call).

What a request may set: `messages`, `tools`, `tool_choice` ("auto" or "none"), `stream`,
`n` (1 only), `max_tokens` / `max_completion_tokens` (cap the session's per-call budget) and
`stop`, and `return_token_ids` (vLLM's field: the answer then carries the prompt's token ids
as the engine saw them, `prompt_token_ids`, and the sampled ones, `choices[0].token_ids`; a
stream sends the prompt's on its first chunk and the sampled ones as chunk deltas). Sampling settings (`temperature`, `top_p`, `seed`, ...) are accepted and ignored: the
rollout's sampling params decide how tokens are drawn, because the trainer computes its
logprobs under them. Other fields are ignored, as clients send many.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plumbing.errors import RolloutsError
from rollouts.tools.base import ToolParser

_ROLES = ("system", "user", "assistant", "tool", "developer")


class AgentRequestError(RolloutsError, ValueError):
    """A request the proxy cannot serve; `status`, `param` and `code` go into the error object."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code


@dataclass(frozen=True)
class ChatRequest:
    """The parts of a chat-completions request the proxy acts on."""

    messages: tuple[dict[str, Any], ...]  # as the chat template takes them
    tools: tuple[dict[str, Any], ...] | None
    parse_tools: bool  # False for tool_choice "none"
    stream: bool
    max_tokens: int | None
    stop: tuple[str, ...]
    model: str
    return_token_ids: bool = False


def _text_content(content: Any, where: str) -> str | None:
    """A message's content as a string (text parts joined); None when absent."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise AgentRequestError(f"{where}.content[{j}]: only text parts are supported",
                                        param=f"{where}.content")  # fmt: skip
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise AgentRequestError(f"{where}.content must be a string or a list of text parts",
                            param=f"{where}.content")  # fmt: skip


def _message(raw: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(raw, Mapping):
        raise AgentRequestError(f"{where} must be an object", param=where)
    role = raw.get("role")
    if role not in _ROLES:
        raise AgentRequestError(f"{where}.role must be one of {list(_ROLES)}, got {role!r}",
                                param=f"{where}.role")  # fmt: skip
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _text_content(raw.get("content"), where)}  # fmt: skip
    calls = raw.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise AgentRequestError(f"{where}.tool_calls must be a list", param=where)
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if isinstance(raw.get(key), str):
            out[key] = raw[key]
    return out


def _tool_call(raw: Any, where: str) -> dict[str, Any]:
    fn = raw.get("function") if isinstance(raw, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise AgentRequestError(f"{where}.function.name is missing", param=where)
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError as exc:
        raise AgentRequestError(f"{where}.function.arguments is not JSON ({exc})",
                                param=where) from exc  # fmt: skip
    return {"id": raw.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": parsed}}  # fmt: skip


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise AgentRequestError(f"{key} must be a positive integer, got {value!r}", param=key)
    return value


def read_chat_request(body: Any) -> ChatRequest:
    """Check a `/v1/chat/completions` body and keep what the proxy acts on.

    Raises:
        AgentRequestError: names the field (e.g. `messages[2].role`) and what is wrong.
    """
    if not isinstance(body, Mapping):
        raise AgentRequestError("the request body must be a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise AgentRequestError("messages must be a non-empty list", param="messages")
    messages = tuple(_message(m, i) for i, m in enumerate(raw_messages))
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, Mapping) for t in tools)):  # fmt: skip
        raise AgentRequestError("tools must be a list of tool objects", param="tools")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise AgentRequestError(
            f"tool_choice {choice!r} is not supported: the proxy samples freely, so only "
            '"auto" and "none" can be honoured', param="tool_choice",
        )  # fmt: skip
    n = body.get("n", 1)
    if n not in (1, None):
        raise AgentRequestError(f"n must be 1 (one session is one trajectory), got {n!r}",
                                param="n")  # fmt: skip
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise AgentRequestError("stop must be a string or a list of strings", param="stop")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    return_ids = body.get("return_token_ids") or False
    if not isinstance(return_ids, bool):
        raise AgentRequestError(f"return_token_ids must be true or false, got {return_ids!r}",
                                param="return_token_ids")  # fmt: skip
    return ChatRequest(messages, tuple(dict(t) for t in tools) if tools else None,
                       choice != "none", bool(body.get("stream", False)), max_tokens, stops,
                       str(body.get("model") or "policy"), return_ids)  # fmt: skip


def canonical(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What decides whether two messages are the same turn (ids of tool calls aside)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or ())  # fmt: skip
    return message["role"], message.get("content") or "", calls


@dataclass(frozen=True)
class Answer:
    """One sampled assistant turn as the agent sees it."""

    message: dict[str, Any]  # role, content, tool_calls (arguments as objects)
    finish_reason: str  # "stop" | "length" | "tool_calls"


def answer_from_text(text: str, finish: str, parser: ToolParser | None, call_prefix: str
                     ) -> Answer:  # fmt: skip
    """The assistant message for a sampled turn's text: well-formed tool calls become
    `tool_calls` (the content is the text before them); anything else stays content, as do
    malformed calls and plain-text call bodies (no argument name to give them)."""
    calls = []
    if parser is not None and finish != "length":
        calls = [c for c in parser(text) if c.error is None and c.text is None]
    content = text
    if calls:  # the calls' text is not content (as an OpenAI server answers)
        at = text.find("<tool_call")
        content = (text[:at] if at >= 0 else text).strip()
    tool_calls = [{"id": f"{call_prefix}-{j}", "type": "function",
                   "function": {"name": c.name, "arguments": dict(c.arguments)}}
                  for j, c in enumerate(calls)]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return Answer(message, "tool_calls" if tool_calls else finish)


def _wire_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message as OpenAI sends it: tool-call arguments as JSON strings."""
    out = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {"name": c["function"]["name"],
                               "arguments": json.dumps(c["function"]["arguments"])}}
            for c in message["tool_calls"]
        ]  # fmt: skip
    return out


TokenIds = tuple[Sequence[int], Sequence[int]]
"""(prompt ids as the engine saw them, sampled ids): what `return_token_ids` answers."""


def chat_completion(answer: Answer, *, completion_id: str, model: str, prompt_tokens: int,
                    completion_tokens: int, token_ids: TokenIds | None = None
                    ) -> dict[str, Any]:  # fmt: skip
    """The non-streaming `chat.completion` object (with vLLM's `prompt_token_ids` and
    `choices[0].token_ids` when `token_ids` is given)."""
    choice = {"index": 0, "message": _wire_message(answer.message), "logprobs": None,
              "finish_reason": answer.finish_reason}  # fmt: skip
    out = {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }  # fmt: skip
    if token_ids is not None:
        out["prompt_token_ids"], choice["token_ids"] = list(token_ids[0]), list(token_ids[1])
    return out


def completion_chunks(answer: Answer, *, completion_id: str, model: str,
                      token_ids: TokenIds | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The `chat.completion.chunk` objects of a streamed answer: role, content, tool calls,
    finish (the answer is sampled whole, then sent in these chunks). With `token_ids`, as
    vLLM streams them: `prompt_token_ids` on the first chunk, and each chunk's sampled ids as
    `choices[0].token_ids` (all of them on the second chunk, none on the others)."""
    wire = _wire_message(answer.message)
    head = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}  # fmt: skip

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if wire.get("content"):
        out.append(chunk({"content": wire["content"]}))
    for j, call in enumerate(wire.get("tool_calls") or ()):
        out.append(chunk({"tool_calls": [{"index": j, **call}]}))
    out.append(chunk({}, answer.finish_reason))
    if token_ids is not None:
        out[0]["prompt_token_ids"] = list(token_ids[0])
        for j, c in enumerate(out):
            c["choices"][0]["token_ids"] = list(token_ids[1]) if j == 1 else []
    return out


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:  # fmt: skip
    """OpenAI's error object (`openai.APIStatusError` reads `body["error"]["message"]`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_list(names: Sequence[str]) -> dict[str, Any]:
    """`GET /v1/models`."""
    return {"object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "rollouts"}
                     for n in names]}  # fmt: skip
