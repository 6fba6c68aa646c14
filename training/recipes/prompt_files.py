"""Prompts to answer (`rollouts generate`, `rollouts eval`) from any file `rollouts sft` or
`rollouts rl` reads, each record validated by the rule of the command that reads its format.

- A chat (`messages`) ending with an assistant turn, or `prompt` + `completion`: SFT's rule
  (`training.data.sft_data.validate_sft_record`: tool calls with null content, JSON-string
  arguments, `tool` messages, `tools`). The prompt is every message before the last assistant
  turn, rendered with the record's `tools` by the chat template as SFT renders that turn's
  context; the last assistant turn (or `completion`) is the expected answer.
- A chat ending with any other turn: an RL prompt whose messages obey SFT's message rule (so a
  tool-call turn in its history is accepted as SFT accepts it); the whole chat is the prompt.
- A `prompt` string alone: RL's rule (`rollouts.prompts.validate_prompt_record`).
Every key but `messages`, `prompt` and `completion` is metadata (`answer` for the reward).

Malformed lines fail loading with every problem listed (file:line:field), as SFT and RL do. A
prompt longer than `max_prompt_len` is one record's problem, not the run's: it is skipped (or,
with `overlong="truncate"`, cut to its last `max_prompt_len` tokens, which keep the question and
the generation header) with a WARNING naming file:line, its tokens and the limit, and the
summary line counts them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from plumbing.errors import ConfigError, DataError
from rollouts.jsonl import iter_jsonl
from rollouts.prompts import PromptItem, checked_prompts, encode_prompt, validate_prompt_record
from training.data.sft_data import validate_sft_record

log = logging.getLogger("rollouts.prompt_files")

Overlong = Literal["drop", "truncate"]
NOT_METADATA = ("messages", "prompt", "completion")
# Appended to a chat that does not end with an assistant turn so that SFT's validator (which
# wants a turn to train on) checks its messages by SFT's rule; removed again at once.
_CONTEXT_ONLY = {"role": "assistant", "content": ""}


@dataclass(frozen=True)
class PromptRecord:
    """One record as a prompt: the messages the model continues, the record's tool schemas and
    the expected answer (the reference turn, `completion`, or None)."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None
    expected: Any


@dataclass(frozen=True)
class PromptFileStats:
    """What `load_prompt_file` kept: `n_records == n_kept + n_skipped` (+ the records after
    `limit`, never read)."""

    n_records: int
    n_kept: int
    n_skipped: int
    n_truncated: int
    max_prompt_len: int | None

    def summary(self, path: str | Path) -> str:
        """One line for the log."""
        line = f"{path}: {self.n_records} records → {self.n_kept} prompts"
        if self.max_prompt_len is not None:
            line += (f"; {self.n_skipped} skipped and {self.n_truncated} truncated as longer "
                     f"than {self.max_prompt_len} tokens")  # fmt: skip
        return line


def prompt_record(obj: Any, source: str) -> tuple[PromptRecord | None, list[str]]:
    """(record, []) of one decoded line, or (None, problems) as `source: field: problem`."""
    if not isinstance(obj, dict) or ("messages" not in obj and "completion" not in obj):
        messages, problems = validate_prompt_record(obj, source)  # RL's `prompt` string
        if messages is None:
            return None, problems
        return PromptRecord(tuple(messages), _tools(obj), obj.get("answer")), []
    chat = obj.get("messages")
    open_ended = isinstance(chat, list) and chat and (
        not isinstance(chat[-1], dict) or chat[-1].get("role") != "assistant"
    )  # fmt: skip
    checked = {**obj, "messages": [*chat, _CONTEXT_ONLY]} if open_ended else obj
    sft, problems = validate_sft_record(checked, source)
    if sft is None:
        return None, problems
    *context, last = sft.messages
    if open_ended:
        return PromptRecord(tuple(context), sft.tools, obj.get("answer")), []
    return PromptRecord(tuple(context), sft.tools, describe_turn(last)), []


def describe_turn(message: Mapping[str, Any]) -> str:
    """An assistant turn as text: its content, then each tool call as `name({arguments})`."""
    calls = [c["function"] for c in message.get("tool_calls") or ()]
    parts = [message.get("content") or ""]
    parts += [f"{fn['name']}({json.dumps(fn.get('arguments', {}))})" for fn in calls]
    return " ".join(p for p in parts if p)


def load_prompt_file(path: str | Path, tokenizer: Any, *, max_prompt_len: int | None = None,
                     overlong: Overlong = "drop", limit: int | None = None,
                     expected_key: str | None = None, limit_why: str = "",
                     template_kwargs: Mapping[str, Any] | None = None
                     ) -> tuple[list[PromptItem], PromptFileStats]:  # fmt: skip
    """Validate and tokenize the prompts of a prompts, chat or prompt/completion JSONL file.

    Args:
        max_prompt_len: the longest prompt in tokens (None: no limit); longer ones are skipped
            or truncated (`overlong`), each with a WARNING.
        limit: stop after this many prompts.
        expected_key: the metadata key the expected answer is stored under (None: not stored).
        limit_why: what the limit is, for the warnings (e.g. "the model's context ...").

    Returns:
        The prompts in file order, and the counts.

    Raises:
        ConfigError: `overlong` is neither "drop" nor "truncate".
        DataError: malformed lines (file:line:field, all collected), no records, or every
            record longer than the limit.
    """
    if overlong not in ("drop", "truncate"):
        raise ConfigError(f"overlong: expected 'drop' or 'truncate', got {overlong!r}")
    errors: list[str] = []
    items: list[PromptItem] = []
    n_records = n_skipped = n_truncated = 0
    for source, obj in iter_jsonl(path, errors):
        if limit is not None and len(items) >= limit:
            break
        record, problems = prompt_record(obj, source)
        errors.extend(problems)
        if record is None or errors:
            continue
        n_records += 1
        ids = encode_prompt(tokenizer, list(record.messages), _listed(record.tools),
                            template_kwargs=template_kwargs)  # fmt: skip
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            _warn_overlong(source, len(ids), max_prompt_len, limit_why, overlong)
            if overlong == "drop":
                n_skipped += 1
                continue
            ids, n_truncated = ids[-max_prompt_len:], n_truncated + 1
        metadata = {k: v for k, v in obj.items() if k not in NOT_METADATA}
        if expected_key is not None and record.expected is not None:
            metadata[expected_key] = record.expected
        items.append(PromptItem(tuple(ids), record.messages, metadata, source))
    stats = PromptFileStats(n_records, len(items), n_skipped, n_truncated, max_prompt_len)
    if not errors and n_records and not items:
        raise DataError(f"{path}: all {n_records} records are longer than {max_prompt_len} "
                        f"tokens{limit_why and f' ({limit_why})'}; nothing to answer")  # fmt: skip
    items = checked_prompts(path, errors, items)
    (log.warning if n_skipped else log.info)("%s", stats.summary(path))
    return items, stats


def _warn_overlong(source: str, n: int, limit: int, why: str, overlong: Overlong) -> None:
    what = ("skipped (--overlong truncate keeps its last tokens instead)" if overlong == "drop"
            else f"truncated to its last {limit} tokens")  # fmt: skip
    log.warning("%s: prompt is %d tokens, longer than the limit of %d%s: %s", source, n, limit,
                f" ({why})" if why else "", what)  # fmt: skip


def _tools(obj: Any) -> tuple[dict, ...] | None:
    tools = obj.get("tools") if isinstance(obj, dict) else None
    return tuple(tools) if isinstance(tools, list) and tools else None


def _listed(tools: tuple[dict, ...] | None) -> list[dict] | None:
    return [dict(t) for t in tools] if tools else None
