"""Tool-call parsers: model text -> `ParsedToolCall`s. Pure; model text is only ever parsed.

Two formats (a `ToolParser` is any `(text) -> list[ParsedToolCall]`, so others plug in):

- Hermes/Qwen JSON (`parse_hermes_tool_calls`), what the tiny model's chat template teaches:
  `<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>`.
  `arguments` may also be a JSON string holding the object (OpenAI style) or be spelled
  `parameters` (Llama 3 style).
- XML (`parse_xml_tool_calls`), the seeds' `<tool_call name="...">` form with one child
  element per argument: `<tool_call name="calculator"><expression>2*3</expression></tool_call>`.
  Values are strings, taken verbatim (no entity decoding; one leading and trailing newline
  stripped) so code with `<` survives. A JSON object body is accepted too:
  `<tool_call name="calculator">{"expression": "2*3"}</tool_call>`. So is the seeds' plain-text
  body, `<tool_call name="calculator">123 + 456</tool_call>`: it becomes the tool's one
  argument at execution (`ParsedToolCall.text`; a tool with several arguments rejects it).

Malformed calls (bad JSON, no name, no closing tag, elements mixed with loose text) come back
flagged with `error`; the rollout turns that into a failed tool result the model reads. Unknown
tool names are not checked here (the parser does not know the tools); execution flags them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rollouts.tools.base import ParsedToolCall

MAX_CALL_CHARS = 64_000  # a longer call body is rejected rather than parsed

_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML_RE = re.compile(r"<tool_call(\s[^>]*)?>(.*?)</tool_call>", re.DOTALL)
_NAME_ATTR_RE = re.compile(r"""\bname\s*=\s*(?:"([^"]*)"|'([^']*)')""")
_ARG_RE = re.compile(r"<([A-Za-z_][\w.-]*)>(.*?)</\1>", re.DOTALL)


def _unterminated(text: str, consumed_to: int, opener: str) -> ParsedToolCall | None:
    """A flagged call for an opening tag after the last complete call, if there is one."""
    start = text.find(opener, consumed_to)
    if start < 0:
        return None
    return ParsedToolCall(
        name="",
        raw=text[start : start + 200],
        error="unterminated tool call: <tool_call> has no closing </tool_call>",
    )


def _arguments_object(value: Any, name: str) -> tuple[dict[str, Any], str | None]:
    if value is None:
        return {}, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as exc:
            return {}, f"tool call {name!r}: arguments string is not valid JSON ({exc})"
    if not isinstance(value, dict):
        return (
            {},
            f"tool call {name!r}: arguments must be a JSON object, got {type(value).__name__}",
        )
    return value, None


def parse_hermes_call(body: str) -> ParsedToolCall:
    """One `<tool_call>` body in the Hermes/Qwen JSON format."""
    raw = body.strip()
    if len(raw) > MAX_CALL_CHARS:
        return ParsedToolCall(
            "", raw=raw[:200], error=f"tool call longer than {MAX_CALL_CHARS} characters"
        )
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        return ParsedToolCall("", raw=raw, error=f"tool call is not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return ParsedToolCall("", raw=raw, error="tool call must be a JSON object with a name")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ParsedToolCall("", raw=raw, error='tool call has no "name" string')
    args, error = _arguments_object(obj.get("arguments", obj.get("parameters")), name)
    return ParsedToolCall(name.strip(), args, raw=raw, error=error)


def parse_hermes_tool_calls(text: str) -> list[ParsedToolCall]:
    """Every `<tool_call>{json}</tool_call>` in `text`, in order (see the module docstring)."""
    calls, end = [], 0
    for match in _HERMES_RE.finditer(text):
        calls.append(parse_hermes_call(match.group(1)))
        end = match.end()
    tail = _unterminated(text, end, "<tool_call>")
    return calls + ([tail] if tail else [])


def parse_xml_call(attrs: str, body: str) -> ParsedToolCall:
    """One `<tool_call name="...">` element in the XML format."""
    raw = f"<tool_call{attrs}>{body}</tool_call>"
    if len(body) > MAX_CALL_CHARS:
        return ParsedToolCall(
            "", raw=raw[:200], error=f"tool call longer than {MAX_CALL_CHARS} characters"
        )
    found = _NAME_ATTR_RE.search(attrs)
    name = (found.group(1) or found.group(2) or "") if found else ""
    if not name.strip():
        return ParsedToolCall(
            "", raw=raw, error='tool call has no name attribute: write <tool_call name="...">'
        )
    name = name.strip()
    stripped = body.strip()
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except (json.JSONDecodeError, RecursionError) as exc:
            return ParsedToolCall(
                name, raw=raw, error=f"tool call {name!r}: body is not valid JSON ({exc})"
            )
        args, error = _arguments_object(obj, name)
        return ParsedToolCall(name, args, raw=raw, error=error)
    args = {}
    for match in _ARG_RE.finditer(body):
        args[match.group(1)] = _strip_one_newline(match.group(2))
    leftover = _ARG_RE.sub("", body).strip()
    if leftover and not args:  # the seeds' form: the body is the tool's one argument
        return ParsedToolCall(name, raw=raw, text=stripped)
    if leftover:
        return ParsedToolCall(
            name, args, raw=raw,
            error=f"tool call {name!r}: expected <argument>value</argument> elements or a "
            f"JSON object, found text {leftover[:80]!r}",
        )  # fmt: skip
    return ParsedToolCall(name, args, raw=raw)


def parse_xml_tool_calls(text: str) -> list[ParsedToolCall]:
    """Every `<tool_call name="...">...</tool_call>` in `text`, in order."""
    calls, end = [], 0
    for match in _XML_RE.finditer(text):
        calls.append(parse_xml_call(match.group(1) or "", match.group(2)))
        end = match.end()
    tail = _unterminated(text, end, "<tool_call")
    return calls + ([tail] if tail else [])


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value
