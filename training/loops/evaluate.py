"""Held-out evaluation helpers: greedy exact-match accuracy through the trainer's model, and the
generations it scored (`eval_generations.jsonl` of an SFT run, shown by `rollouts view`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.backend.pytorch import PyTorchTrainingBackend

CheckFn = Callable[[str, str], bool]


@dataclass(frozen=True)
class EvalPrompt:
    """A prompt (chat messages) and its ground-truth answer."""

    messages: tuple[dict[str, Any], ...]
    answer: str


def encode_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Chat-template token ids of `messages` followed by the assistant generation header."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


async def greedy_accuracy(
    backend: PyTorchTrainingBackend,
    prompts: Sequence[EvalPrompt],
    check: CheckFn,
    *,
    max_new_tokens: int = 16,
    generations: Callable[[list[dict[str, Any]]], None] | None = None,
) -> dict[str, float]:
    """Greedy-decode every prompt and report the fraction `check(completion, answer)` accepts.

    `generations`, if given, is called with one record per prompt: `{"prompt", "answer",
    "completion", "correct"}` (the prompt as `role: content` lines).

    Under torchrun the prompts are split across ranks (`generate_greedy`); the answers, and so
    the accuracy, are those of one process."""
    if not prompts:
        return {}
    tok = backend.tokenizer
    ids = [encode_prompt(tok, p.messages) for p in prompts]
    outputs = await backend.generate_greedy(ids, max_new_tokens=max_new_tokens).result()
    texts = tok.batch_decode(outputs, skip_special_tokens=True)
    right = [bool(check(text, p.answer)) for text, p in zip(texts, prompts, strict=True)]
    if generations is not None:
        generations([{"prompt": "\n".join(f"{m['role']}: {m['content']}" for m in p.messages),
                      "answer": p.answer, "completion": text, "correct": ok}
                     for p, text, ok in zip(prompts, texts, right, strict=True)])  # fmt: skip
    return {"accuracy": sum(right) / len(prompts)}


def write_generations(path: str | Path, step: int, records: Sequence[dict[str, Any]]) -> None:
    """Record step `step`'s evaluation generations in a JSONL file, one line per record.

    Rows of this step and later ones already in the file are dropped first: a resumed run
    evaluates those steps again (as `JsonlLogger` replaces their metrics rows).
    """
    path = Path(path)
    kept = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] < step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a torn line of a killed run
    rows = [json.dumps({"step": step, **r}, ensure_ascii=False) + "\n" for r in records]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept + rows), encoding="utf-8")
    tmp.replace(path)
