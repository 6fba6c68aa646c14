"""Parse and validate `sampling_params` the way SGLang does (pure Python, no torch).

Also the two request error types and the small type-check helpers `/generate` parsing shares
(see `params.py` for what each error means on the wire). The messages of the sampling checks
are SGLang's own (`sampling_params.py::verify`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 128
GREEDY_EPS = 1e-6

# Keys SGLang accepts in `sampling_params` that this engine does not implement; a request that
# sets one gets a clear 400 instead of being silently served without it.
_UNSUPPORTED_SAMPLING = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex")
_IGNORED_SAMPLING = ("spaces_between_special_tokens", "custom_params", "stream_interval")


class RequestValidationError(ValueError):
    """The request body does not have the declared shape (pydantic-style 400)."""


class BadRequestError(ValueError):
    """The request is well-formed but its values are invalid (SGLang `ValueError`, 400)."""


@dataclass(frozen=True)
class SamplingParams:
    """Normalised sampling parameters of one request. Greedy is `top_k == 1`, as in SGLang."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    sampling_seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _type_error(field: str, expected: str, value: Any) -> RequestValidationError:
    return RequestValidationError(
        f"1 validation error for GenerateReqInput\n{field}\n  Input should be {expected} "
        f"[input_value={value!r}]"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_list(field: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise _type_error(field, "a valid list of integers", value)
    return value


def _per_item(field: str, value: Any, batch: int, check: Callable[[Any], bool], expected: str):
    """Expand a scalar-or-list request field to one value per prompt."""
    values = value if isinstance(value, list) else [value] * batch
    if len(values) != batch:
        raise BadRequestError(f"The length of {field} ({len(values)}) must equal the batch size.")
    for v in values:
        if not check(v):
            raise _type_error(field, expected, value)
    return values


def parse_sampling_params(raw: Any, defaults: Mapping[str, Any], vocab_size: int):
    """Returns (SamplingParams, max_new_tokens_given). Raises the two request errors."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _type_error("sampling_params", "a valid dictionary", raw)
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise BadRequestError(f"Unknown sampling parameter(s): {', '.join(unknown)}.")
    for key in _UNSUPPORTED_SAMPLING:
        if raw.get(key) is not None:
            raise BadRequestError(
                f"Sampling parameter {key!r} is not supported by the local engine."
            )
    merged = {**defaults, **{k: v for k, v in raw.items() if v is not None}}

    def number(key: str, default: float) -> float:
        value = merged.get(key, default)
        if not _is_number(value):
            raise BadRequestError(f"{key} must be a number, got {value!r}.")
        return float(value)

    def integer(key: str, default: int | None) -> int | None:
        value = merged.get(key, default)
        if value is not None and not _is_int(value):
            raise BadRequestError(f"{key} must be an integer, got {value!r}.")
        return value

    def flag(key: str, default: bool) -> bool:
        value = merged.get(key, default)
        if not isinstance(value, bool):
            raise BadRequestError(f"{key} must be a boolean, got {value!r}.")
        return value

    temperature = number("temperature", 1.0)
    top_k = integer("top_k", -1)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise BadRequestError(
            f"temperature must be a non-negative finite number, got {temperature}."
        )
    if temperature < GREEDY_EPS:  # SGLang: greedy is top_k = 1 at temperature 1
        temperature, top_k = 1.0, 1
    top_p, min_p = number("top_p", 1.0), number("min_p", 0.0)
    frequency_penalty = number("frequency_penalty", 0.0)
    presence_penalty = number("presence_penalty", 0.0)
    repetition_penalty = number("repetition_penalty", 1.0)
    min_new_tokens = integer("min_new_tokens", 0)
    max_new_tokens = integer("max_new_tokens", None)
    n = integer("n", 1)
    if not 0.0 < top_p <= 1.0:
        raise BadRequestError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise BadRequestError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k == 0 or top_k < -1:
        raise BadRequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if not -2.0 <= frequency_penalty <= 2.0:
        raise BadRequestError(f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.")
    if not -2.0 <= presence_penalty <= 2.0:
        raise BadRequestError(f"presence_penalty must be in [-2, 2], got {presence_penalty}.")
    if not 0.0 < repetition_penalty <= 2.0:
        raise BadRequestError(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition_penalty}."
        )
    if min_new_tokens < 0:
        raise BadRequestError(
            f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}."
        )
    if max_new_tokens is not None:
        if max_new_tokens < 0:
            raise BadRequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if min_new_tokens > max_new_tokens:
            raise BadRequestError(
                f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got "
                f"{min_new_tokens}."
            )
    if n < 1:
        raise BadRequestError(f"n must be at least 1, got {n}.")
    if top_k > vocab_size:  # the whole vocabulary; keeps the value inside int64 for torch
        top_k = -1

    stop = merged.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequestError(f"stop must be a non-empty string or a list of them, got {stop!r}.")
    stop_token_ids = merged.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise BadRequestError(f"stop_token_ids must be a list of integers, got {stop_token_ids!r}.")
    outside = sorted({t for t in stop_token_ids if not 0 <= t < vocab_size})
    if outside:
        raise BadRequestError(
            f"stop_token_ids must be token ids in [0, {vocab_size - 1}], got {outside[:10]}."
        )
    logit_bias = merged.get("logit_bias") or {}
    if not isinstance(logit_bias, dict):
        raise BadRequestError(f"logit_bias must be an object, got {logit_bias!r}.")
    bias: list[tuple[int, float]] = []
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequestError(f"logit_bias keys must be token ids, got {key!r}.") from None
        if not 0 <= token_id < vocab_size:
            raise BadRequestError(
                f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}."
            )
        if not _is_number(value) or math.isnan(value) or value == math.inf:
            raise BadRequestError(
                f"logit_bias values must be finite numbers or -inf (a ban), got {value!r}."
            )
        bias.append((token_id, float(value)))
    seed = integer("sampling_seed", None)
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:  # SGLang 0.5.23's range
        raise BadRequestError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    params = SamplingParams(
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k is None else top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        min_new_tokens=min_new_tokens,
        n=n,
        stop=tuple(stop),
        stop_token_ids=frozenset(stop_token_ids),
        ignore_eos=flag("ignore_eos", False),
        skip_special_tokens=flag("skip_special_tokens", True),
        no_stop_trim=flag("no_stop_trim", False),
        logit_bias=tuple(bias),
        sampling_seed=seed,
    )
    return params, max_new_tokens is not None


_SAMPLING_KEYS = {f for f in SamplingParams.__dataclass_fields__} | {
    *_UNSUPPORTED_SAMPLING,
    *_IGNORED_SAMPLING,
}
