"""Tool records and running one parsed tool call into a `ToolCallRecord` the model sees.

A tool is data (`Tool`: name, description, JSON-schema parameters) plus one plain async
callable, its executor: `async (arguments) -> ToolResult`. An executor reports an expected
failure by raising `ToolError` (the message is shown to the model) or returning
`ToolResult(success=False)`. `execute_tool_call` never raises for a bad call: parse errors,
unknown tools, invalid arguments, executor exceptions and timeouts all become a failed
`ToolCallRecord` whose `output` is the text the model reads in its tool message. Only
cancellation from outside (an aborted rollout) propagates.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

import trio

from plumbing.errors import RolloutsError
from rollouts.types import ToolCallRecord

log = logging.getLogger("rollouts.tools")

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


class ToolError(RolloutsError, RuntimeError):
    """A tool could not do what was asked; the message is shown to the model as the result."""


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call read from model text. `error` set: the call is malformed (shown to the model)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    raw: str = ""  # the call as the model wrote it, for logs
    error: str | None = None
    text: str | None = None  # a plain-text body (`<tool_call name="calculator">1 + 2</tool_call>`)
    """The whole body as the tool's one argument; execution names that argument (see
    `text_as_arguments`). Set only when `arguments` is empty."""


@dataclass(frozen=True)
class ToolResult:
    """What an executor returns: the output text and whether the call did what was asked."""

    output: str
    success: bool = True
    error: str | None = None


ToolParser: TypeAlias = Callable[[str], list[ParsedToolCall]]
"""(model turn text) -> the tool calls in it, in order; malformed ones flagged, never raised."""

ToolExecutor: TypeAlias = Callable[[Mapping[str, Any]], Awaitable[ToolResult]]
"""async (arguments) -> ToolResult; raise ToolError for a failure the model should read."""


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: its spec for the chat template and its executor.

    Attributes:
        name: what the model writes in a call.
        description: one line shown to the model.
        parameters: JSON schema of the arguments object (`{"type": "object", ...}`).
        executor: runs a call; see `ToolExecutor`.
        timeout_s: wall-clock budget for one call, enforced by `execute_tool_call`.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    executor: ToolExecutor
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"tool name {self.name!r} must match {_NAME_RE.pattern}")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type object")
        if not self.timeout_s > 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")
        object.__setattr__(self, "parameters", dict(self.parameters))

    def spec(self) -> dict[str, Any]:
        """The OpenAI/HF function spec (what `apply_chat_template(tools=...)` takes)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


def tool_specs(tools: Iterable[Tool]) -> list[dict[str, Any]]:
    """The `tools=` argument of `tokenizer.apply_chat_template` for these tools."""
    return [t.spec() for t in tools]


def tools_by_name(tools: Iterable[Tool]) -> dict[str, Tool]:
    """Index tools by name. Raises ValueError on a duplicate name."""
    out: dict[str, Tool] = {}
    for t in tools:
        if t.name in out:
            raise ValueError(f"two tools are named {t.name!r}")
        out[t.name] = t
    return out


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": Mapping,
    "array": list,
}


def check_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """A message naming the first problem of `arguments` against `schema`, or None if fine.

    Checks required keys, unknown keys (when additionalProperties is false) and the top-level
    JSON type of each argument; not a full JSON-schema validator.
    """
    missing = [k for k in schema.get("required", ()) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    props = schema.get("properties") or {}
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        expected = (props.get(key) or {}).get("type")
        if not isinstance(expected, str) or expected not in _JSON_TYPES:
            continue
        is_bool = isinstance(value, bool)
        if not isinstance(value, _JSON_TYPES[expected]) or (is_bool and expected != "boolean"):
            return f"argument {key!r} must be of type {expected}, got {type(value).__name__}"
    return None


def text_as_arguments(schema: Mapping[str, Any], text: str) -> tuple[dict[str, Any], str | None]:
    """A plain-text call body as the arguments of a tool with one argument: ({name: text}, None),
    or ({}, why not) when the tool takes several (the seeds' `<tool_call name="...">` form)."""
    required = list(schema.get("required", ()))
    props = list(schema.get("properties", {}))
    names = required if len(required) == 1 else props
    if len(names) != 1:
        return {}, (
            f"a plain-text body fits a tool with one argument; this one takes {props}: write "
            "<name>value</name> elements or a JSON object"
        )
    return {names[0]: text}, None


def truncate_text(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars`: its start and its end, with a note saying how much was dropped.

    The end is kept because that is where a traceback says what went wrong.
    """
    if len(text) <= max_chars:
        return text
    head = max_chars - max_chars // 2
    tail = max_chars - head
    dropped = len(text) - max_chars
    return f"{text[:head]}\n[... {dropped} characters truncated ...]\n{text[len(text) - tail :]}"


def format_tool_output(output: str, error: str | None, max_chars: int) -> str:
    """The tool message text: the output, then `Error: ...` when the call failed."""
    parts = [truncate_text(output, max_chars)] if output else []
    if error is not None:
        parts.append(f"Error: {error}")
    return "\n".join(parts)


def _failed(call: ParsedToolCall, error: str, started: float, max_chars: int,
            output: str = "") -> ToolCallRecord:  # fmt: skip
    return ToolCallRecord(
        name=call.name,
        arguments=call.arguments,
        output=format_tool_output(output, error, max_chars),
        success=False,
        latency_s=time.perf_counter() - started,
        error=error,
    )


async def execute_tool_call(
    call: ParsedToolCall, tools: Mapping[str, Tool], *, max_output_chars: int = 4000
) -> ToolCallRecord:
    """Run `call` against `tools` under the tool's timeout; every failure becomes data.

    Returns:
        A record whose `output` is the tool message text (truncated to `max_output_chars`,
        with `Error: ...` appended on failure) and whose `error` names what went wrong.
    """
    started = time.perf_counter()
    if call.error is not None:
        return _failed(call, call.error, started, max_output_chars)
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return _failed(call, f"unknown tool {call.name!r} (available: {known})", started,
                       max_output_chars)  # fmt: skip
    if call.text is not None:
        arguments, problem = text_as_arguments(tool.parameters, call.text)
        if problem is not None:
            return _failed(call, f"{call.name}: {problem}", started, max_output_chars)
        call = replace(call, arguments=arguments, text=None)
    problem = check_arguments(tool.parameters, call.arguments)
    if problem is not None:
        return _failed(call, f"{call.name}: {problem}", started, max_output_chars)
    result: ToolResult | None = None
    with trio.move_on_after(tool.timeout_s):
        try:
            result = await tool.executor(dict(call.arguments))
        except ToolError as exc:
            return _failed(call, str(exc), started, max_output_chars)
        except Exception as exc:  # a bug in a tool must not kill the rollout; it is logged
            log.warning("tool %s raised %s: %s", call.name, type(exc).__name__, exc)
            return _failed(call, f"tool raised {type(exc).__name__}: {exc}", started,
                           max_output_chars)  # fmt: skip
    if result is None:
        return _failed(call, f"{call.name} timed out after {tool.timeout_s} s", started,
                       max_output_chars)  # fmt: skip
    if not isinstance(result, ToolResult):
        return _failed(call, f"executor returned {type(result).__name__}, not a ToolResult",
                       started, max_output_chars)  # fmt: skip
    if not result.success:
        error = result.error or "the tool reported a failure"
        return _failed(call, error, started, max_output_chars, output=result.output)
    return ToolCallRecord(
        name=call.name,
        arguments=call.arguments,
        output=truncate_text(result.output, max_output_chars),
        success=True,
        latency_s=time.perf_counter() - started,
    )


async def execute_tool_calls(
    calls: Sequence[ParsedToolCall],
    tools: Mapping[str, Tool],
    *,
    max_calls: int = 8,
    max_output_chars: int = 4000,
) -> list[ToolCallRecord]:
    """Run calls one after another (bounded resource use, deterministic order).

    Calls beyond `max_calls` are not run; each gets a failed record saying so, so the model
    learns the limit.
    """
    out = []
    for i, call in enumerate(calls):
        if i >= max_calls:
            error = f"not run: at most {max_calls} tool calls per turn"
            out.append(_failed(call, error, time.perf_counter(), max_output_chars))
        else:
            out.append(await execute_tool_call(call, tools, max_output_chars=max_output_chars))
    return out


def tool_message(record: ToolCallRecord) -> dict[str, Any]:
    """The chat message carrying a tool call's result back to the model."""
    return {"role": "tool", "name": record.name, "content": record.output}
