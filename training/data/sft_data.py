"""Load and validate SFT datasets from JSONL, before any training starts.

Two record formats are accepted, one JSON object per line (blank lines are skipped):

- chat: `{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}` in the OpenAI
  format. Assistant messages may carry `tool_calls` (content may then be null or absent) and
  `weight` (0 or 1, as in OpenAI fine-tuning: 0 keeps the turn as context but does not train
  on it); a trained assistant turn may not open the conversation (its role header could not be
  told apart from its content); tool messages may carry `tool_call_id` and `name`. Other keys on a message (such as
  `reasoning_content`) are passed through to the chat template untouched.
- prompt/completion: `{"prompt": "...", "completion": "..."}` (strings), turned into a user
  message followed by an assistant message.

What is guaranteed: every line is checked and ALL problems are collected; if there is any, one
`DataError` is raised whose message lists the first 10 as `file:line: field: problem` and says
how many more there are. Nothing is silently dropped: a record is either returned or reported.
Tool-call `arguments` given as a JSON string (OpenAI style) are parsed into an object, because
Hugging Face chat templates render them with `tojson` and would otherwise double-encode them.

What is not covered: multimodal content parts (content must be a string), and any check that a
chat template can render a record; `training.data.tokenize` reports those.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plumbing.errors import DataError
from rollouts.jsonl import format_errors, iter_jsonl

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class SFTRecord:
    """One validated conversation, ready for a chat template.

    `messages` are plain dicts in the OpenAI/HF chat format; `source` is "path:line" so every
    later error (template failure, prefix violation) can point at the input line.
    """

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None
    source: str


def load_sft_jsonl(path: str | Path) -> list[SFTRecord]:
    """Read an SFT JSONL file into validated records, or fail with every problem listed.

    Args:
        path: the JSONL file. Lines are decoded as UTF-8 one by one, so an undecodable byte is
            reported with its line number.

    Returns:
        One `SFTRecord` per non-blank line, in file order.

    Raises:
        DataError: if any line is malformed (invalid UTF-8 or JSON, wrong types, unknown role,
            empty conversation, no assistant turn to train on), or the file has no records.
        OSError: if the file cannot be read.
    """
    name = str(path)
    records: list[SFTRecord] = []
    errors: list[str] = []
    for source, obj in iter_jsonl(path, errors):
        record, problems = validate_sft_record(obj, source)
        errors.extend(problems)
        if record is not None:
            records.append(record)
    if errors:
        raise DataError(format_errors(errors, what=name))
    if not records:
        raise DataError(f"{name}: no records (the file is empty or has only blank lines)")
    return records


def validate_sft_record(obj: Any, source: str) -> tuple[SFTRecord | None, list[str]]:
    """Check one decoded JSON value and build its record.

    Args:
        obj: the decoded JSON line.
        source: "path:line", prefixed to every problem and stored on the record.

    Returns:
        `(record, [])` when valid, else `(None, problems)` with every problem found, each as
        "source: field: problem".
    """
    report = _Report(source)
    problems = report.problems
    if not isinstance(obj, dict):
        report("", f"expected a JSON object, got {_type_name(obj)}")
        return None, problems
    has_chat = "messages" in obj
    has_pc = "prompt" in obj or "completion" in obj
    if has_chat and has_pc:
        report("", "has both 'messages' and 'prompt'/'completion'; use one format")
        return None, problems
    if has_chat:
        messages = _validate_messages(obj["messages"], report)
    elif has_pc:
        messages = _messages_from_prompt_completion(obj, report)
    else:
        report("", "expected a 'messages' list or 'prompt' and 'completion' strings")
        return None, problems
    tools = _validate_tools(obj.get("tools"), report)
    if problems or messages is None:
        return None, problems
    return SFTRecord(messages=messages, tools=tools, source=source), problems


def _messages_from_prompt_completion(obj: dict, report: _Report) -> tuple[dict, ...] | None:
    ok = True
    for key in ("prompt", "completion"):
        if key not in obj:
            report(key, "missing")
            ok = False
        elif not isinstance(obj[key], str):
            report(key, f"expected a string, got {_type_name(obj[key])}")
            ok = False
    if not ok:
        return None
    return (
        {"role": "user", "content": obj["prompt"]},
        {"role": "assistant", "content": obj["completion"]},
    )


def _validate_messages(value: Any, report: _Report) -> tuple[dict, ...] | None:
    if not isinstance(value, list):
        report("messages", f"expected a list, got {_type_name(value)}")
        return None
    if not value:
        report("messages", "empty conversation")
        return None
    messages = [_validate_message(m, f"messages[{i}]", report) for i, m in enumerate(value)]
    if any(m is None for m in messages):
        return None
    trained = [m["role"] == "assistant" and m.get("weight", 1) != 0 for m in messages]
    if trained[0]:
        report(
            "messages[0]",
            "a trained assistant turn cannot open the conversation; add the "
            "turn it answers first, or give it weight 0",
        )
        return None
    if not any(trained):
        has_assistant = any(m["role"] == "assistant" for m in messages)
        report(
            "messages",
            "every assistant turn has weight 0; nothing to train on"
            if has_assistant
            else "no assistant turn to train on",
        )
        return None
    return tuple(messages)


def _validate_message(msg: Any, field: str, report: _Report) -> dict | None:
    if not isinstance(msg, dict):
        report(field, f"expected an object, got {_type_name(msg)}")
        return None
    n_problems = len(report.problems)
    role = msg.get("role")
    if "role" not in msg:
        report(f"{field}.role", "missing")
    elif not isinstance(role, str):
        report(f"{field}.role", f"expected a string, got {_type_name(role)}")
    elif role not in ROLES:
        report(f"{field}.role", f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
    out = dict(msg)
    content = msg.get("content")
    has_calls = role == "assistant" and msg.get("tool_calls") not in (None, [])
    if content is None and has_calls:
        out["content"] = ""  # OpenAI allows null content beside tool calls; templates want str
    elif "content" not in msg:
        report(f"{field}.content", "missing")
    elif not isinstance(content, str):
        hint = " (multimodal content parts are not supported)" if isinstance(content, list) else ""
        report(f"{field}.content", f"expected a string, got {_type_name(content)}{hint}")
    for key in ("tool_calls", "weight"):
        if key in msg and role != "assistant":
            report(f"{field}.{key}", f"only allowed on assistant messages, not {role!r}")
    if "weight" in msg and (type(msg["weight"]) is not int or msg["weight"] not in (0, 1)):
        report(f"{field}.weight", f"expected 0 or 1, got {msg['weight']!r}")
    for key in ("tool_call_id", "name"):
        if key in msg and not isinstance(msg[key], str):
            report(f"{field}.{key}", f"expected a string, got {_type_name(msg[key])}")
    if role == "assistant" and msg.get("tool_calls") is not None:
        out["tool_calls"] = _validate_tool_calls(msg["tool_calls"], f"{field}.tool_calls", report)
    if len(report.problems) > n_problems:
        return None
    return out


def _validate_tool_calls(value: Any, field: str, report: _Report) -> list[dict]:
    if not isinstance(value, list):
        report(field, f"expected a list, got {_type_name(value)}")
        return []
    calls = []
    for i, call in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(call, dict):
            report(where, f"expected an object, got {_type_name(call)}")
            continue
        fn = call.get("function")
        if not isinstance(fn, dict):
            report(f"{where}.function", f"expected an object, got {_type_name(fn)}")
            continue
        if not isinstance(fn.get("name"), str) or not fn.get("name"):
            report(f"{where}.function.name", "expected a non-empty string")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                # the column is the string's own (its text is JSON inside a JSON string)
                report(f"{where}.function.arguments",
                       f"invalid JSON string: {e.msg} (column {e.colno} of the string)")  # fmt: skip
                continue
        if not isinstance(args, dict):
            report(f"{where}.function.arguments", f"expected an object, got {_type_name(args)}")
            continue
        calls.append({**call, "function": {**fn, "arguments": args}})
    return calls


def _validate_tools(value: Any, report: _Report) -> tuple[dict, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        report("tools", f"expected a list, got {_type_name(value)}")
        return None
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            report(f"tools[{i}]", f"expected an object, got {_type_name(tool)}")
        elif not isinstance(tool.get("function"), dict):
            report(f"tools[{i}].function", "expected an object")
        elif not isinstance(tool["function"].get("name"), str):
            report(f"tools[{i}].function.name", "expected a string")
    return tuple(value) if value else None


class _Report:
    """Collects "source: field: problem" lines for one record."""

    def __init__(self, source: str):
        self.source = source
        self.problems: list[str] = []

    def __call__(self, field: str, problem: str) -> None:
        where = f"{self.source}: {field}" if field else self.source
        self.problems.append(f"{where}: {problem}")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "list",
        dict: "object",
    }.get(type(value), type(value).__name__)
