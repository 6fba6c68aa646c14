"""Reading JSONL input line by line with errors that name the file, line and problem.

Shared by every loader (SFT data, RL prompts): undecodable bytes, invalid JSON and blank lines
are handled here once; the caller validates each decoded object and collects its own errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

MAX_ERRORS_SHOWN = 10


def iter_jsonl(path: str | Path, errors: list[str]) -> Iterator[tuple[str, Any]]:
    """Yield `(source, obj)` for each non-blank line ("path:line", decoded JSON).

    Lines that are not UTF-8 or not JSON are appended to `errors` (as "path:line: problem")
    and skipped, so one pass reports every bad line.

    Raises:
        OSError: the file cannot be read.
    """
    name = str(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            source = f"{name}:{lineno}"
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark, as some editors write
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                field = _field_with_bad_bytes(raw)
                errors.append(
                    f"{source}: {field + ': ' if field else ''}invalid UTF-8 byte "
                    f"0x{raw[e.start]:02x} at byte {e.start + 1}"
                )
                continue
            if not text.strip():
                continue
            try:
                yield source, json.loads(text)
            except json.JSONDecodeError as e:
                errors.append(f"{source}: invalid JSON: {e.msg} (column {e.colno})")


def format_errors(errors: Sequence[str], *, what: str) -> str:
    """One message: a header, the first 10 problems, and how many more there are."""
    shown = errors[:MAX_ERRORS_SHOWN]
    lines = [f"{len(errors)} invalid record(s) in {what}:", *shown]
    if len(errors) > len(shown):
        lines.append(f"... and {len(errors) - len(shown)} more")
    return "\n".join(lines)


def _field_with_bad_bytes(raw: bytes) -> str:
    """The JSON path of the first string holding an undecodable byte, or "" if not found."""
    try:
        obj = json.loads(raw.decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return ""

    def find(value: Any, path: str) -> str | None:
        if isinstance(value, str):
            return path if "\ufffd" in value else None
        if isinstance(value, dict):
            items = [(f"{path}.{k}" if path else k, k, v) for k, v in value.items()]
        elif isinstance(value, list):
            items = [(f"{path}[{i}]", "", v) for i, v in enumerate(value)]
        else:
            return None
        for sub, key, item in items:
            found = sub if "\ufffd" in key else find(item, sub)
            if found:
                return found
        return None

    return find(obj, "") or ""
