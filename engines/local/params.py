"""Parse and validate `/generate` request bodies the way SGLang does (pure Python, no torch).

Two kinds of failure, as in SGLang (sglang_protocol.md §1.7, §3.2):
- `RequestValidationError`: the body does not have the declared types (bad JSON, a string where
  a bool belongs). SGLang answers these from pydantic: 400 `{"object": "error", ...}`.
- `BadRequestError`: the types are right but the values are not (`top_p: 0`, empty input, a
  prompt longer than the context). SGLang raises `ValueError`: 400 `{"error": {"message"}}`.

The messages of the sampling checks are SGLang's own (`sampling_params.py::verify`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .sampling_params import (
    BadRequestError,
    SamplingParams,
    _int_list,
    _is_int,
    _per_item,
    _type_error,
    parse_sampling_params,
)

# No tokenizer packs more than this many characters per token on average (BPE merges of
# natural text average about 4): a cheap upper bound on what a context can hold.
MAX_CHARS_PER_TOKEN = 32


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
    lora_name: str | None = None  # the LoRA adapter serving it (`lora_path`); None = base
    extra_key: str | None = None  # prefix-cache namespace (SGLang's `extra_key`)


@dataclass(frozen=True)
class GenerateRequest:
    items: list[GenerateItem]
    is_batch: bool  # answer with a JSON list (batch input or n > 1)
    stream: bool


@dataclass(frozen=True)
class RequestBounds:
    """Server-side bounds on one request (`--max-n`, `--max-request-items`)."""

    max_n: int = 256
    max_request_items: int = 4096


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context_len: int
    sampling_defaults: Mapping[str, Any]  # from the model's generation_config.json


def _check_n(raw_params: Any, bounds: RequestBounds) -> None:
    """`n` past the bound is refused before the other fields are even parsed."""
    for params in raw_params if isinstance(raw_params, list) else [raw_params]:
        n = params.get("n") if isinstance(params, dict) else None
        if _is_int(n) and n > bounds.max_n:
            raise BadRequestError(
                f"n must be at most {bounds.max_n} on this server (--max-n), got {n}."
            )


def _prompts(body: Mapping[str, Any], encode: Callable[[str], list[int]], limits: ModelLimits):
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
        # Tokenizing runs on the event loop: refuse text that cannot fit before paying for it.
        max_chars = limits.context_len * MAX_CHARS_PER_TOKEN
        for t in texts:
            if len(t) > max_chars:
                raise BadRequestError(
                    f"The input text ({len(t)} characters) is longer than the model's context "
                    f"length ({limits.context_len} tokens) can hold."
                )
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


def _lora_names(raw: Any, batch: int) -> list[str | None]:
    """`lora_path`: one adapter name for every prompt, or one (or None) per prompt (SGLang's
    `GenerateReqInput._normalize_lora_paths`)."""
    if raw is None or isinstance(raw, str):
        return [raw or None] * batch
    if not isinstance(raw, list) or not all(r is None or isinstance(r, str) for r in raw):
        raise _type_error("lora_path", "a valid string or list of strings", raw)
    if len(raw) != batch:
        raise BadRequestError(f"lora_path list length ({len(raw)}) must match batch size ({batch})")
    return [r or None for r in raw]


def _extra_keys(raw: Any, batch: int) -> list[str | None]:
    """`extra_key`: one string for every prompt, or one per prompt; "" means none (SGLang's
    `GenerateReqInput._normalize_extra_key`, with its messages)."""
    if raw is None or isinstance(raw, str):
        return [raw or None] * batch
    if not isinstance(raw, list):
        raise BadRequestError("extra_key should be a list or a string.")
    if len(raw) != batch:
        raise BadRequestError("The length of extra_key should be equal to the batch size.")
    if any(not isinstance(value, str) for value in raw):
        raise BadRequestError("Every extra_key should be a string.")
    return [value or None for value in raw]


def parse_generate_request(
    body: Any,
    limits: ModelLimits,
    encode: Callable[[str], list[int]],
    bounds: RequestBounds = RequestBounds(),
) -> GenerateRequest:
    """Validate a `/generate` body and flatten it into items (prompt-major, `n` per prompt).

    Every bound is checked before anything per item is built, so an absurd `n` or batch costs
    nothing but this check.
    """
    if not isinstance(body, dict):
        raise _type_error("body", "a valid dictionary", body)
    _check_n(body.get("sampling_params"), bounds)
    raw_prompts = body.get("text") if body.get("text") is not None else body.get("input_ids")
    many = isinstance(raw_prompts, list) and raw_prompts and not _is_int(raw_prompts[0])
    if many and len(raw_prompts) > bounds.max_request_items:
        raise BadRequestError(
            f"The batch has {len(raw_prompts)} prompts; this server allows at most "
            f"{bounds.max_request_items} per request (--max-request-items)."
        )
    prompts, is_batch = _prompts(body, encode, limits)
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
    if batch * n > bounds.max_request_items:
        raise BadRequestError(
            f"The request asks for {batch} prompts x n={n} = {batch * n} generations; this "
            f"server allows at most {bounds.max_request_items} per request "
            "(--max-request-items)."
        )
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
    loras = _lora_names(body.get("lora_path"), batch)
    extra_keys = _extra_keys(body.get("extra_key"), batch)

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
                    lora_name=loras[i],
                    extra_key=extra_keys[i],
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
