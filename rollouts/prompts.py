"""RL prompts: JSONL records of chat messages plus ground truth, tokenized once.

Format, one JSON object per line: `{"messages": [{"role": "user", "content": "12+34"}],
"answer": "46", ...}`. `messages` (or a plain `"prompt"` string, turned into one user message)
is the conversation the model continues; every other key is metadata handed to the reward
function (`sample.metadata["answer"]`). Any malformed line fails loading with file:line:field.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plumbing.errors import DataError
from rollouts.jsonl import format_errors, iter_jsonl

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PromptItem:
    """One RL prompt: its token ids (chat template + generation header) and metadata."""

    prompt_ids: tuple[int, ...]
    messages: tuple[Mapping[str, Any], ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_ids": list(self.prompt_ids),
            "messages": [dict(m) for m in self.messages],
            "metadata": dict(self.metadata),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PromptItem:
        return cls(tuple(d["prompt_ids"]), tuple(d["messages"]), d["metadata"], d["source"])


def prompt_item(tokenizer: Any, messages: list[Mapping[str, Any]],
                metadata: Mapping[str, Any] | None = None, *, tools=None,
                template_kwargs: Mapping[str, Any] | None = None) -> PromptItem:  # fmt: skip
    """A PromptItem from chat messages, rendered with the tokenizer's chat template."""
    ids = encode_prompt(tokenizer, messages, tools, template_kwargs=template_kwargs)
    return PromptItem(tuple(ids), tuple(messages), dict(metadata or {}))


def validate_prompt_record(obj: Any, source: str) -> tuple[list[dict] | None, list[str]]:
    """(messages, problems) of one prompt record: its messages, or None and each problem."""
    if not isinstance(obj, dict):
        return None, [f"{source}: expected a JSON object, got {type(obj).__name__}"]
    if "messages" not in obj and isinstance(obj.get("prompt"), str):
        return [{"role": "user", "content": obj["prompt"]}], []
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        return None, [f"{source}: messages: expected a non-empty list of messages"]
    problems = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            problems.append(f"{source}: messages[{i}]: expected an object")
        elif m.get("role") not in ROLES:
            problems.append(
                f"{source}: messages[{i}].role: unknown role {m.get('role')!r} "
                f"(expected one of {', '.join(ROLES)})"
            )
        elif not isinstance(m.get("content"), str):
            problems.append(f"{source}: messages[{i}].content: expected a string")
    return (None if problems else messages), problems


def encode_prompt(tokenizer: Any, messages: list[Mapping[str, Any]], tools=None, *,
                  template_kwargs: Mapping[str, Any] | None = None) -> list[int]:  # fmt: skip
    """Token ids of `messages` rendered by the chat template with the generation header.

    `template_kwargs` are extra template variables (e.g. `rollouts.thinking.
    thinking_template_kwargs`: `{"enable_thinking": False}`).
    """
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tools=tools, add_generation_prompt=True, tokenize=True,
        # callers measure the prompt against the context themselves (and say which record):
        # no "indexing errors" warning from transformers for one longer than model_max_length
        tokenizer_kwargs={"verbose": False},
        **dict(template_kwargs or {}),
    )  # fmt: skip
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def load_prompt_jsonl(path: str | Path, tokenizer: Any, *, max_prompt_len: int | None = None,
                      template_kwargs: Mapping[str, Any] | None = None
                      ) -> list[PromptItem]:  # fmt: skip
    """Load, validate and tokenize RL prompts (`template_kwargs`: extra template variables).

    Raises:
        DataError: malformed lines (all collected, first 10 shown), prompts longer than
            `max_prompt_len`, or an empty file.
    """
    errors: list[str] = []
    items: list[PromptItem] = []
    for source, obj, messages in iter_prompt_records(path, errors):
        ids = encode_prompt(tokenizer, messages, obj.get("tools"), template_kwargs=template_kwargs)
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            errors.append(f"{source}: messages: prompt is {len(ids)} tokens > {max_prompt_len}")
            continue
        metadata = {k: v for k, v in obj.items() if k not in ("messages", "prompt")}
        items.append(PromptItem(tuple(ids), tuple(messages), metadata, source))
    return checked_prompts(path, errors, items)


def iter_prompt_records(path: str | Path, errors: list[str]
                        ) -> Iterator[tuple[str, dict[str, Any], list[dict[str, Any]]]]:  # fmt: skip
    """(source, record, messages) of each valid prompt record; each problem is appended to
    `errors` as `file:line: field: problem` and its record skipped."""
    for source, obj in iter_jsonl(path, errors):
        messages, problems = validate_prompt_record(obj, source)
        errors.extend(problems)
        if messages is not None:
            yield source, obj, messages


def checked_prompts(path: str | Path, errors: list[str], items: list[PromptItem]
                    ) -> list[PromptItem]:  # fmt: skip
    """`items`, once the file had no errors and at least one prompt.

    Raises:
        DataError: every collected error (first 10 shown), or an empty file.
    """
    if errors:
        raise DataError(format_errors(errors, what=str(path)))
    if not items:
        raise DataError(f"{path}: no prompts (the file is empty or has only blank lines)")
    return items
