"""Parse and validate `/generate` request bodies the way SGLang does (pure Python, no torch).

Two kinds of failure, as in SGLang (sglang_protocol.md §1.7, §3.2):
- `RequestValidationError`: the body does not have the declared types (bad JSON, a string where
  a bool belongs). SGLang answers these from pydantic: 400 `{"object": "error", ...}`.
- `BadRequestError`: the types are right but the values are not (`top_p: 0`, empty input, a
  prompt longer than the context). SGLang raises `ValueError`: 400 `{"error": {"message"}}`.

The messages of the sampling checks are SGLang's own (`sampling_params.py::verify`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class GenerateItem:
    """One flattened unit of work: one prompt, one sample."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int  # resolved: 0 <= start < len(input_ids)
    top_logprobs_num: int
    return_text_in_logprobs: bool


@dataclass(frozen=True)
class GenerateRequest:
    items: list[GenerateItem]
    is_batch: bool  # answer with a JSON list (batch input or n > 1)
    stream: bool


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context_len: int
    sampling_defaults: Mapping[str, Any]  # from the model's generation_config.json


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

    stop = merged.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequestError(f"stop must be a non-empty string or a list of them, got {stop!r}.")
    stop_token_ids = merged.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise BadRequestError(f"stop_token_ids must be a list of integers, got {stop_token_ids!r}.")
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
        if not _is_number(value) or math.isnan(value):
            raise BadRequestError(f"logit_bias values must be numbers, got {value!r}.")
        bias.append((token_id, float(value)))
    seed = integer("sampling_seed", None)
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


def _prompts(body: Mapping[str, Any], encode: Callable[[str], list[int]]):
    """Returns (list of token-id prompts, is_batch)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise BadRequestError("input_embeds is not supported by the local engine.")
    if (text is None) == (input_ids is None):
        raise BadRequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, str):
            texts, is_batch = [text], False
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts, is_batch = text, True
        else:
            raise _type_error("text", "a valid string or list of strings", text)
        if not texts:
            raise BadRequestError("text cannot be empty.")
        prompts = [encode(t) for t in texts]
        if any(not p for p in prompts):
            raise BadRequestError("The input text is empty after tokenization.")
        return prompts, is_batch
    if not isinstance(input_ids, list):
        raise _type_error("input_ids", "a valid list", input_ids)
    if not input_ids:
        raise BadRequestError("input_ids cannot be empty.")
    if isinstance(input_ids[0], list):
        prompts = [_int_list("input_ids", p) for p in input_ids]
        if any(not p for p in prompts):
            raise BadRequestError("input_ids cannot be empty.")
        return prompts, True
    return [_int_list("input_ids", input_ids)], False


def _rids(raw: Any, batch: int, is_batch: bool) -> list[str]:
    if raw is None:
        return [uuid.uuid4().hex for _ in range(batch)]
    if isinstance(raw, str):
        return [raw] if not is_batch else [f"{raw}_{i}" for i in range(batch)]
    if not isinstance(raw, list) or not all(isinstance(r, str) for r in raw):
        raise _type_error("rid", "a valid string or list of strings", raw)
    if len(raw) != batch:
        raise BadRequestError(
            "The specified rids length mismatch with the batch_size for batch processing."
        )
    duplicates = sorted({r for r in raw if raw.count(r) > 1})
    if duplicates:
        raise BadRequestError(f"Duplicate request IDs detected within the request: {duplicates}")
    return list(raw)


def parse_generate_request(
    body: Any, limits: ModelLimits, encode: Callable[[str], list[int]]
) -> GenerateRequest:
    """Validate a `/generate` body and flatten it into items (prompt-major, `n` per prompt)."""
    if not isinstance(body, dict):
        raise _type_error("body", "a valid dictionary", body)
    prompts, is_batch = _prompts(body, encode)
    batch = len(prompts)
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if len(raw_params) != batch:
            raise BadRequestError(
                f"The length of sampling_params ({len(raw_params)}) must equal the batch size "
                f"({batch})."
            )
        parsed = [
            parse_sampling_params(p, limits.sampling_defaults, limits.vocab_size)
            for p in raw_params
        ]
    else:
        parsed = [
            parse_sampling_params(raw_params, limits.sampling_defaults, limits.vocab_size)
        ] * batch
    n = parsed[0][0].n
    if any(p.n != n for p, _ in parsed):
        raise BadRequestError("The n parameter must be the same for all requests in a batch.")
    stream = body.get("stream", False)
    text_in_logprobs = body.get("return_text_in_logprobs", False)
    for field, value in (("stream", stream), ("return_text_in_logprobs", text_in_logprobs)):
        if not isinstance(value, bool):
            raise _type_error(field, "a valid boolean", value)
    return_logprob = _per_item(
        "return_logprob",
        body.get("return_logprob", False),
        batch,
        lambda v: isinstance(v, bool),
        "a valid boolean",
    )
    starts = _per_item(
        "logprob_start_len", body.get("logprob_start_len", -1), batch, _is_int, "a valid integer"
    )
    tops = _per_item(
        "top_logprobs_num", body.get("top_logprobs_num", 0), batch, _is_int, "a valid integer"
    )
    rids = _rids(body.get("rid"), batch, is_batch)

    items: list[GenerateItem] = []
    for i, prompt in enumerate(prompts):
        params, explicit_max = parsed[i]
        _check_prompt(prompt, limits, params, explicit_max)
        start = starts[i]
        if start == -1:
            start = len(prompt) - 1
        if start < 0:
            raise BadRequestError(f"logprob_start_len must be -1 or >= 0, got {start}.")
        if return_logprob[i] and start >= len(prompt):
            raise BadRequestError(
                f"logprob_start_len ({start}) is higher than the number of input tokens "
                f"({len(prompt)}). Request with a lower logprob_start_len."
            )
        if tops[i] < 0:
            raise BadRequestError(f"top_logprobs_num must be >= 0, got {tops[i]}.")
        if params.max_new_tokens > limits.context_len - len(prompt):
            params = _replace_max_new(params, limits.context_len - len(prompt))
        for _ in range(n):
            items.append(
                GenerateItem(
                    rid=rids[i] if n == 1 else uuid.uuid4().hex,
                    input_ids=prompt,
                    params=params,
                    return_logprob=return_logprob[i],
                    logprob_start_len=min(start, len(prompt) - 1),
                    top_logprobs_num=min(tops[i], limits.vocab_size),
                    return_text_in_logprobs=text_in_logprobs,
                )
            )
    return GenerateRequest(items=items, is_batch=is_batch or n > 1, stream=stream)


def _check_prompt(prompt: Sequence[int], limits: ModelLimits, params, explicit_max: bool):
    length, context = len(prompt), limits.context_len
    if length >= context:
        raise BadRequestError(
            f"The input ({length} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    if explicit_max and params.max_new_tokens + length >= context:
        raise BadRequestError(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {params.max_new_tokens + length} tokens: {length} "
            f"tokens from the input messages and {params.max_new_tokens} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    bad = sorted({t for t in prompt if not 0 <= t < limits.vocab_size})
    if bad:
        raise BadRequestError(
            f"The input_ids contain token ids outside the vocabulary [0, {limits.vocab_size}): "
            f"{bad[:10]}."
        )


def _replace_max_new(params: SamplingParams, value: int) -> SamplingParams:
    return replace(params, max_new_tokens=value, min_new_tokens=min(params.min_new_tokens, value))
