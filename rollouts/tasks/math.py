"""Math word problems (GSM8K-style): final-answer extraction and a correctness reward.

Prompt records: `{"messages": [{"role": "user", "content": "<problem>"}], "answer": "72"}`
(GSM8K's `#### 72` line reduced to the number). The model's final answer is the content of its
last `\\boxed{...}`, else the last number in the response; both sides are compared as numbers
when they parse as numbers (commas, `$`, `%` and a trailing `.0` ignored), else as strings.
Model output is only ever parsed as text, never evaluated.
"""

from __future__ import annotations

import re

from rollouts.rewards import boxed_answer

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_final_answer(text: str) -> str | None:
    """The last `\\boxed{}` content, else the last number in `text`, else None."""
    boxed = boxed_answer(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip("%").rstrip(".").strip()
    try:
        return float(cleaned)
    except ValueError:
        return None


def answers_match(predicted: str, truth: str) -> bool:
    """Numeric equality (to 1e-6) when both are numbers, else whitespace-insensitive equality."""
    a, b = _as_number(predicted), _as_number(truth)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    return predicted.strip().lower() == truth.strip().lower()


def math_correctness_reward(sample) -> dict[str, float]:
    """1 when the response's final answer equals `metadata["answer"]`, else 0 (vector form)."""
    predicted = extract_final_answer(sample.response_text)
    correct = float(
        predicted is not None and answers_match(predicted, str(sample.metadata["answer"]))
    )
    return {"correct": correct, "total": correct}
