"""Held-out evaluation helpers: greedy exact-match accuracy through the trainer's model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
) -> dict[str, float]:
    """Greedy-decode every prompt and report the fraction `check(completion, answer)` accepts.

    Under torchrun the prompts are split across ranks (`generate_greedy`); the answers, and so
    the accuracy, are those of one process."""
    if not prompts:
        return {}
    tok = backend.tokenizer
    ids = [encode_prompt(tok, p.messages) for p in prompts]
    outputs = await backend.generate_greedy(ids, max_new_tokens=max_new_tokens).result()
    texts = tok.batch_decode(outputs, skip_special_tokens=True)
    correct = sum(check(text, p.answer) for text, p in zip(texts, prompts, strict=True))
    return {"accuracy": correct / len(prompts)}
