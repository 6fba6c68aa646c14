"""OpenAI request bodies translated into native `/generate` bodies (the local engine).

Why a module of its own: the translation (field names, the chat template, what OpenAI allows
that `/generate` does not) is pure request shaping, tested by its answers; `openai_api.py`
keeps the routes and the shape of their responses. What the native parser then validates is
not repeated here: validation, sampling and logprobs are exactly those of `/generate`.
"""

from __future__ import annotations

from typing import Any

from .openai_tools import wants_tool_calls
from .params import MAX_CHARS_PER_TOKEN
from .sampling_params import BadRequestError, RequestValidationError
from .state import EngineState

# OpenAI field -> SGLang sampling key (identity where equal).
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "n": "n",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "logit_bias": "logit_bias",
}


def _sampling(body: dict[str, Any], max_tokens: Any) -> dict[str, Any]:
    params = {dst: body[src] for src, dst in _SAMPLING_FIELDS.items() if body.get(src) is not None}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    return params


def completion_native(body: dict[str, Any]) -> dict[str, Any]:
    """A `/v1/completions` body as a native `/generate` body (raises `BadRequestError`)."""
    prompt = body.get("prompt")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequestError(f"max_tokens must be a positive integer, got {max_tokens!r}.")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or logprobs < 0):
        raise BadRequestError(f"logprobs must be a non-negative integer, got {logprobs!r}.")
    if body.get("echo") and body.get("stream"):
        raise BadRequestError("echo is not supported together with stream.")
    is_ids = isinstance(prompt, list) and prompt and not isinstance(prompt[0], str)
    native: dict[str, Any] = {("input_ids" if is_ids else "text"): prompt}
    native.update(
        sampling_params=_sampling(body, max_tokens),
        return_logprob=logprobs is not None,
        top_logprobs_num=logprobs or 0,
        logprob_start_len=0 if body.get("echo") else -1,
        return_text_in_logprobs=True,
        stream=body.get("stream") or False,
    )
    if body.get("rid") is not None:
        native["rid"] = body["rid"]
    return native


def chat_native(state: EngineState, body: dict[str, Any]) -> dict[str, Any]:
    """A `/v1/chat/completions` body as a native `/generate` body: the chat template applied
    with the engine's tokenizer (raises `RequestValidationError` / `BadRequestError`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestValidationError("messages: Input should be a non-empty list")
    rendered = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise RequestValidationError("messages: each message needs a role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        rendered.append({**m, "content": content})
    # The chat template tokenizes on the event loop: refuse what cannot fit before paying.
    chars = sum(len(m["content"]) for m in rendered if isinstance(m["content"], str))
    if state.limits and chars > state.limits.context_len * MAX_CHARS_PER_TOKEN:
        raise BadRequestError(
            f"The messages ({chars} characters) are longer than the model's context length "
            f"({state.limits.context_len} tokens) can hold."
        )
    try:
        input_ids = state.tokenizer.apply_chat_template(
            rendered, tools=body.get("tools"), add_generation_prompt=True, tokenize=True
        )
    except Exception as exc:
        raise BadRequestError(f"Failed to apply the chat template: {exc}") from exc
    if not isinstance(input_ids, list):  # transformers 5 returns a BatchEncoding
        input_ids = input_ids["input_ids"]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    top = body.get("top_logprobs") or 0
    params = _sampling(body, max_tokens)
    if wants_tool_calls(body, state.config.tool_call_parser):  # tool-call tags may be special
        params.setdefault("skip_special_tokens", False)
    native: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": params,
        "return_logprob": bool(body.get("logprobs")),
        "top_logprobs_num": top if body.get("logprobs") else 0,
        "return_text_in_logprobs": True,
        "stream": body.get("stream") or False,
    }
    if body.get("rid") is not None:
        native["rid"] = body["rid"]
    return native
