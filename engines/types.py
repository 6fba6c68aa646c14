"""What engines return, the `InferenceEngine` protocol, and the engine error types.

Pure data and parsing (no torch, no HTTP). The parsers accept older and newer SGLang response
shapes (sglang_protocol.md §1.4): extra keys are ignored, optional keys may be missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Literal, Protocol

from plumbing.errors import EngineError

PauseMode = Literal["abort", "retract", "in_place"]

# Pause modes (`/pause_generation` with "retract"/"in_place") and `weight_version` in answers
# exist from SGLang 0.5.6 on; older servers cannot be refitted the way this project does.
MIN_SGLANG_VERSION = (0, 5, 6)


def parse_version(text: str) -> tuple[int, ...] | None:
    """The leading release numbers of a version string ("0.5.23+x" → (0, 5, 23)); None if none."""
    numbers: list[int] = []
    for part in text.strip().lstrip("v").split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(numbers) or None


class EngineUnavailableError(EngineError):
    """The engine could not be reached, dropped the connection, or kept answering 503."""


class EngineTimeoutError(EngineError, TimeoutError):
    """The engine accepted the request but did not answer within the call's timeout."""


class WeightSyncError(EngineError):
    """A weight sync failed on at least one engine (the message names each one)."""


@dataclass(frozen=True)
class FinishReason:
    """Why generation stopped. `matched` is the stop token id or stop string for "stop"."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    @classmethod
    def from_json(cls, raw: Any) -> FinishReason:
        if isinstance(raw, str):  # very old servers sent a bare string
            return cls(type=raw)
        if not isinstance(raw, Mapping) or "type" not in raw:
            raise ValueError(f"unrecognised finish_reason {raw!r}")
        return cls(
            type=str(raw["type"]),
            matched=raw.get("matched"),
            length=raw.get("length"),
            message=raw.get("message"),
        )


@dataclass(frozen=True)
class WeightSpan:
    """Output tokens [start, end) were generated with weights `version`."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class GenerateResult:
    """One completed (or aborted) sample, token ids and logprobs exactly as the engine produced.

    `output_logprobs[i]` is log p(output_ids[i] | prompt + output_ids[:i]) under the engine's
    sampling distribution (temperature-scaled, as SGLang reports by default); None when logprobs
    were not requested. `latency_s` is measured by the client, end to end.
    """

    rid: str
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...] | None
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str | None
    latency_s: float
    input_logprobs: tuple[float | None, ...] | None = None
    output_top_logprobs: tuple[tuple[tuple[float, int], ...] | None, ...] | None = None
    weight_versions: tuple[WeightSpan, ...] = ()
    num_retractions: int = 0

    @property
    def aborted(self) -> bool:
        return self.finish_reason.type == "abort"


@dataclass(frozen=True)
class ScoreResult:
    """Logprobs of `input_ids[start:]`, each given everything before it (teacher forcing)."""

    logprobs: tuple[float, ...]
    prompt_tokens: int
    weight_version: str | None
    latency_s: float


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    weight_version: str | None
    raw: Mapping[str, Any]


def _logprob(value: Any) -> float:
    return math.nan if value is None else float(value)


_shared_ints: list[int] = []  # _shared_ints[i] is i: one int object per token id in use
_MAX_SHARED_ID = 1 << 22


def _token_ids(ids: Sequence[Any]) -> tuple[int, ...]:
    """`ids` as a tuple of ints, each id the one shared int object for its value.

    Why: JSON decoding makes a fresh 28-byte int per token; a batch of 1,024 x 16 samples x
    2,048 tokens held ~93 MiB per 1,000 samples in id objects alone, 13 MiB shared (issue 31).
    Anything that is not a plain id in range (negative, huge, not an int) goes through `int`
    as before.
    """
    global _shared_ints
    table = _shared_ints
    try:
        if not ids or min(ids) < 0 or (high := max(ids)) >= _MAX_SHARED_ID:
            return tuple(map(int, ids))
        if high >= len(table):  # a new list swapped in whole: never half-grown for a thread
            table = _shared_ints = table + list(range(len(table), high + 1))
        return tuple(map(table.__getitem__, ids))
    except TypeError:  # a float or a string among them: `int` converts or raises as before
        return tuple(map(int, ids))


def _output_logprobs(triples: Sequence[Sequence[Any]]) -> tuple[float, ...]:
    """The logprobs of `[logprob, token id, text]` triples, None as NaN.

    C-level `map`s instead of a generator: a step of 1,024 x 16 samples x 2,048 tokens has 33M
    of them, and the generator cost the controller ~40 % of its parsing CPU (issue 31)."""
    values = tuple(map(itemgetter(0), triples))
    if None in values:
        return tuple(map(_logprob, values))
    return tuple(map(float, values))


def _top(rows: Any) -> tuple[tuple[tuple[float, int], ...] | None, ...] | None:
    if rows is None:
        return None
    return tuple(
        None if row is None else tuple((_logprob(t[0]), int(t[1])) for t in row) for row in rows
    )


def parse_generate_response(obj: Any, *, latency_s: float, prompt_len: int) -> GenerateResult:
    """Turn one `/generate` JSON object into a `GenerateResult`. Raises ValueError if malformed."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("meta_info"), Mapping):
        raise ValueError(f"not a /generate result object: {str(obj)[:300]}")
    meta = obj["meta_info"]
    output_lp = meta.get("output_token_logprobs")
    output_ids = obj.get("output_ids")
    if output_ids is None:  # SGLang <= ~0.4.6 only sent output_ids with --skip-tokenizer-init
        if output_lp is None:
            raise ValueError(
                "the response has no output_ids (an old SGLang server?); request logprobs so "
                "the token ids can be read from output_token_logprobs"
            )
        output_ids = [t[1] for t in output_lp]
    input_lp = meta.get("input_token_logprobs")
    spans = tuple(
        WeightSpan(str(s["version"]), int(s["start"]), int(s["end"]))
        for s in meta.get("weight_versions") or ()
    )
    version = meta.get("weight_version")
    return GenerateResult(
        rid=str(meta.get("id", "")),
        output_ids=_token_ids(output_ids),
        output_logprobs=None if output_lp is None else _output_logprobs(output_lp),
        text=obj.get("text") or "",
        finish_reason=FinishReason.from_json(meta.get("finish_reason")),
        prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
        completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        weight_version=None if version is None else str(version),
        latency_s=latency_s,
        input_logprobs=None
        if input_lp is None
        else tuple(None if t[0] is None else float(t[0]) for t in input_lp),
        output_top_logprobs=_top(meta.get("output_top_logprobs")),
        weight_versions=spans,
        num_retractions=int(meta.get("num_retractions") or 0),
    )


def generate_body(
    input_ids, params, rid, return_logprob, top_logprobs_num, logprob_start_len, lora_path=None
) -> dict[str, Any]:
    """A `/generate` body; `no_stop_trim: true` unless given, so `text` is all of `output_ids`.
    `lora_path` (adapter name, or one per prompt) is sent only when it names an adapter."""
    if isinstance(params, list):
        params = [{"no_stop_trim": True, **p} for p in params]
    else:
        params = {"no_stop_trim": True, **params}
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": params,
        "return_logprob": return_logprob,
    }
    if rid is not None:
        body["rid"] = rid
    if top_logprobs_num:
        body["top_logprobs_num"] = top_logprobs_num
    if logprob_start_len is not None:
        body["logprob_start_len"] = logprob_start_len
    if lora_path is not None and (isinstance(lora_path, str) or any(lora_path)):
        body["lora_path"] = lora_path
    return body


def check_version(info: Mapping[str, Any], url: str) -> str:
    """The `version` of a `/server_info` answer; EngineError if older than MIN_SGLANG_VERSION."""
    version = str(info.get("version", ""))
    number = parse_version(version)
    minimum = ".".join(map(str, MIN_SGLANG_VERSION))
    if number is None or number < MIN_SGLANG_VERSION:
        raise EngineError(
            f"the server reports SGLang version {version or '(none)'!r}; rollouts needs "
            f"SGLang >= {minimum} (pause modes and weight_version appeared there): "
            f"pip install 'sglang>={minimum}'",
            url=url,
        )
    return version


class InferenceEngine(Protocol):
    """What the rollout side needs from an inference server (SGLang's protocol, §4 DESIGN.md)."""

    @property
    def url(self) -> str: ...

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
        logprob_start_len: int | None = None,
    ) -> GenerateResult: ...

    async def score(
        self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0
    ) -> ScoreResult: ...

    async def update_weights_from_disk(
        self,
        path: str,
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> str: ...

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def abort(self, rid: str) -> None: ...

    async def abort_all(self) -> None: ...

    async def model_info(self) -> ModelInfo: ...

    async def wait_healthy(self, timeout_s: float = 600.0) -> None: ...
