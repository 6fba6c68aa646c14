"""The state of one in-flight generation in the local engine (no torch).

Ownership rule: the scheduler mutates a `Sequence` only on the trio thread and only while no
model step is running; the model runner reads it during a step. That is what makes sharing it
between the trio thread and the worker thread safe without locks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import trio

from .params import GenerateItem

TopLogprobs = list[tuple[float, int]]


@dataclass(eq=False)
class Sequence:
    item: GenerateItem
    created_at: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None
    # [version, start, end) token spans: which weights produced which output tokens.
    weight_spans: list[list[Any]] = field(default_factory=list)
    cached_tokens: int = 0
    num_retractions: int = 0
    prefilled: bool = False  # input logprobs are computed on the first prefill only
    finish_reason: dict[str, Any] | None = None
    error: str | None = None  # set when generation failed inside the engine (HTTP 500)
    text: str = ""  # detokenised output so far (kept current only when stop strings are set)
    runner_state: Any = None  # opaque per-sequence state of the model runner (e.g. a generator)
    changed: trio.Event = field(default_factory=trio.Event)  # replaced and set on every update

    @property
    def rid(self) -> str:
        return self.item.rid

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def prefill_ids(self) -> list[int]:
        """Tokens to prefill: the prompt, plus what was generated before a retraction."""
        return self.item.input_ids + self.output_ids

    def append(self, token: int, logprob: float, top: TopLogprobs | None, version: str) -> None:
        index = len(self.output_ids)
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top.append(top)
        if self.weight_spans and self.weight_spans[-1][0] == version:
            self.weight_spans[-1][2] = index + 1
        else:
            self.weight_spans.append([version, index, index + 1])


# What one model step hands back to the scheduler (runner.py), which applies it on the trio
# thread: the runner never mutates a Sequence beyond its `runner_state` slot.
@dataclass
class Prefilled:
    seq: Sequence
    input_logprobs: list[float | None] | None
    input_top: list[TopLogprobs | None] | None
    cached_tokens: int


@dataclass
class StepOutput:
    tokens: list[tuple[Sequence, int, float, TopLogprobs | None]] = field(default_factory=list)
    prefilled: list[Prefilled] = field(default_factory=list)
    errors: list[tuple[Sequence, str]] = field(default_factory=list)
