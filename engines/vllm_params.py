"""SGLang sampling params → a vLLM `/v1/completions` body, and its answer → `GenerateResult`.

Why a module of its own: the translation is pure data (no HTTP), and it is where a reader
looks up which SGLang parameter becomes which vLLM one, and which have no vLLM meaning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .types import FinishReason, GenerateResult

# SGLang name -> vLLM `/v1/completions` name (same meaning).
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
_SAME = {
    "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "skip_special_tokens",
    "spaces_between_special_tokens", "seed",
}  # fmt: skip


def completion_body(
    model: str | None,
    prompt: list[int],
    params: Mapping[str, Any],
    *,
    rid: str | None,
    logprobs: int | None,
    cache_salt: str,
) -> dict[str, Any]:
    """The JSON body of one `/v1/completions` request for SGLang-style `params`.

    `no_stop_trim` (SGLang keeps the stop string in `text`) becomes vLLM's
    `include_stop_str_in_output`; it defaults to true as in `SGLangEngine`, so `text` decodes
    all of the output ids. `logprobs`: None for none, k for the sampled token's plus the top k.

    Raises:
        ValueError: `n` != 1, or a parameter vLLM has no equivalent for (named).
    """
    if params.get("n", 1) != 1:
        raise ValueError("generate() returns one sample; use generate_batch() for n > 1")
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "return_token_ids": True,
        "include_stop_str_in_output": bool(params.get("no_stop_trim", True)),
        "cache_salt": cache_salt,
        "max_tokens": 128,  # SGLang's default max_new_tokens
    }
    for key, value in params.items():
        if key in ("n", "no_stop_trim"):
            continue
        if key in _RENAMED:
            body[_RENAMED[key]] = value
        elif key in _SAME:
            body[key] = value
        else:
            raise ValueError(f"sampling param {key!r} has no vLLM /v1/completions equivalent "
                             f"(supported: {sorted(_SAME | set(_RENAMED) | {'n', 'no_stop_trim'})})"
                             )  # fmt: skip
    if rid is not None:
        body["request_id"] = rid
    if logprobs is not None:
        body["logprobs"] = logprobs
        body["return_tokens_as_token_ids"] = True  # top-k keys "token_id:N", not ambiguous text
    return body


def _token_id(key: str) -> int:
    return int(key.rsplit(":", 1)[1])


def parse_completion(
    obj: Any,
    *,
    rid: str,
    prompt_len: int,
    latency_s: float,
    weight_version: str | None,
    with_logprobs: bool,
    top_logprobs_num: int = 0,
) -> GenerateResult:
    """Turn one `/v1/completions` answer (one choice) into a `GenerateResult`.

    vLLM's finish reasons are "stop" (EOS, a stop token or string: `stop_reason` holds the
    token id or string, None for EOS), "length" and "abort". Raises ValueError if malformed.
    """
    if not isinstance(obj, Mapping) or not obj.get("choices"):
        raise ValueError(f"not a /v1/completions answer: {str(obj)[:300]}")
    choice = obj["choices"][0]
    ids = tuple(int(t) for t in choice.get("token_ids") or ())
    reason = choice.get("finish_reason") or "abort"
    matched = choice.get("stop_reason")
    if reason == "stop" and matched is None and ids:
        matched = ids[-1]  # EOS: SGLang names the token
    lps = choice.get("logprobs")
    output_lp: tuple[float, ...] | None = None
    top: tuple[tuple[tuple[float, int], ...] | None, ...] | None = None
    if with_logprobs:
        raw = (lps or {}).get("token_logprobs") or []
        output_lp = tuple(math.nan if v is None else float(v) for v in raw)
        if len(output_lp) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(output_lp)} logprobs")
        rows = (lps or {}).get("top_logprobs") or []
        if top_logprobs_num:  # vLLM adds the sampled token when it is not in the top k
            top = tuple(
                None if r is None else tuple(
                    sorted(((float(v), _token_id(k)) for k, v in r.items()), reverse=True)
                )[:top_logprobs_num]
                for r in rows
            )  # fmt: skip
    usage = obj.get("usage") or {}
    return GenerateResult(
        rid=rid or str(obj.get("id", "")),
        output_ids=ids,
        output_logprobs=output_lp,
        text=choice.get("text") or "",
        finish_reason=FinishReason(type=str(reason), matched=matched),
        prompt_tokens=int(usage.get("prompt_tokens") or prompt_len),
        completion_tokens=int(usage.get("completion_tokens") or len(ids)),
        cached_tokens=int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0),
        weight_version=weight_version,
        latency_s=latency_s,
        output_top_logprobs=top,
    )
