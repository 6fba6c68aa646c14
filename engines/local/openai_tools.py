"""Tool calls and token ids in the local engine's OpenAI answers (`openai_api.py` uses these).

Tool calls: a chat request with `tools` (and `tool_choice` not "none") has the model's text
read by the server's tool-call parser (`--tool-call-parser`, SGLang's and vLLM's flag): well-
formed calls come back as `message.tool_calls` with `finish_reason: "tool_calls"`, the text
before them as `content`; a malformed call stays in the content, as text. Such a request
keeps special tokens in its text (as vLLM's Hermes parser asks), since tool-call tags may be
special tokens. A parser is named `hermes` (`<tool_call>{json}</tool_call>`, alias `qwen25`),
`xml` (`<tool_call name="...">`), `none`, or `module:function` (any `(text) -> calls` with
`name`, `arguments`, `error` and `text` like `rollouts.tools.ParsedToolCall`). The parsers
live with the tools on the rollout side (`rollouts.tools.parsers`), above this package, so the
name is resolved by import at the first request that needs it (a config names an extension
the same way) rather than imported here.

Token ids: `return_token_ids: true` (vLLM's field) adds the prompt's ids and the sampled ids,
exactly the native `/generate` request's `input_ids` and its `output_ids`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

BUILTIN_PARSERS = {
    "hermes": "rollouts.tools.parsers:parse_hermes_tool_calls",
    "qwen25": "rollouts.tools.parsers:parse_hermes_tool_calls",  # SGLang's name for the format
    "xml": "rollouts.tools.parsers:parse_xml_tool_calls",
}
CALL_MARK = "<tool_call"  # where every built-in format's call starts


def check_parser_name(name: str | None) -> None:
    """Raise ValueError for a `--tool-call-parser` value that names no parser."""
    if name in (None, "none") or name in BUILTIN_PARSERS:
        return
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"--tool-call-parser {name!r}: use one of {[*BUILTIN_PARSERS, 'none']} "
                         "or module:function")  # fmt: skip


def resolve_parser(name: str) -> Callable[[str], list[Any]]:
    """The parser `name` stands for (raises ValueError naming the flag if it cannot load)."""
    module, _, attr = BUILTIN_PARSERS.get(name, name).partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--tool-call-parser {name!r} cannot be loaded: {exc}") from exc


def wants_tool_calls(body: dict[str, Any], parser_name: str | None) -> bool:
    """Whether this chat request's answer is read for tool calls."""
    return (parser_name not in (None, "none") and bool(body.get("tools"))
            and body.get("tool_choice", "auto") != "none")  # fmt: skip


def split_tool_calls(text: str, parser: Callable[[str], list[Any]], call_prefix: str
                     ) -> tuple[str | None, list[dict[str, Any]]]:  # fmt: skip
    """(content, tool_calls) of a finished answer: `tool_calls` empty when it made none."""
    calls = [c for c in parser(text) if c.error is None and c.text is None]
    if not calls:
        return text, []
    at = text.find(CALL_MARK)
    content = (text[:at] if at >= 0 else text).strip()
    wire = [{"id": f"{call_prefix}-{j}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}
            for j, c in enumerate(calls)]  # fmt: skip
    return content or None, wire


def streamable_text(text: str) -> str:
    """The part of a growing answer that is content whatever follows: the text before a tool
    call's mark, less a tail that may be the mark's beginning."""
    at = text.find(CALL_MARK)
    if at >= 0:
        return text[:at]
    for k in range(min(len(CALL_MARK) - 1, len(text)), 0, -1):
        if text.endswith(CALL_MARK[:k]):
            return text[:-k]
    return text


def token_ids_fields(seq: Any, body: dict[str, Any]) -> dict[str, Any]:
    """A choice's `prompt_token_ids` / `token_ids` for `return_token_ids` (else nothing)."""
    if not body.get("return_token_ids"):
        return {}
    return {"prompt_token_ids": list(seq.item.input_ids), "token_ids": list(seq.output_ids)}
