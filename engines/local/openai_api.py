"""OpenAI-compatible routes on the local engine: `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (sglang_protocol.md §3.3), enough for the official `openai` client.

Requests are translated into native `/generate` items (openai_requests.py), so validation,
sampling and logprobs are exactly those of `/generate`. A chat answer's tool calls come back as
`tool_calls` (read by `--tool-call-parser`), and `return_token_ids` adds the prompt's and the
sampled token ids as vLLM does (openai_tools.py). Not covered: `echo` together with streaming,
`best_of`, `suffix`, tool calls streamed before the answer is finished (a streamed call is sent
whole, in the chunk that finishes its choice).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from .asgi import (
    SSE_DONE,
    App,
    Request,
    Response,
    StreamingResponse,
    json_response,
    object_error,
    sse_event,
)
from .lora_api import adapter_cards, openai_lora_path
from .openai_requests import chat_native, completion_native
from .openai_tools import split_tool_calls, streamable_text, token_ids_fields, wants_tool_calls
from .params import GenerateRequest
from .route_helpers import (
    bad_adapter_in_band,
    not_ready,
    read_json,
    stream_sequences,
    wait_finished,
)
from .sampling_params import BadRequestError, RequestValidationError
from .sequence import Sequence
from .state import EngineState


def bad_request(message: str) -> Response:
    return object_error(message, 400, "BadRequestError")


def _finish(seq: Sequence) -> tuple[str | None, Any]:
    reason = seq.finish_reason
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


def _usage(seqs: list[Sequence], n: int) -> dict[str, Any]:
    prompt = sum(len(s.item.input_ids) for s in seqs[::n])
    completion = sum(len(s.output_ids) for s in seqs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def register_openai_routes(app: App, state: EngineState) -> None:
    def card() -> dict[str, Any]:
        name = state.served_model_name
        max_len = state.limits.context_len if state.limits else None
        return {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": max_len,
        }

    @app.route("/v1/models")
    async def list_models(request: Request) -> Response:
        return json_response({"object": "list", "data": [card(), *adapter_cards(state, card())]})

    @app.route("/v1/models/{id}")
    async def get_model(request: Request) -> Response:
        model = request.path_params["id"]
        if model != state.served_model_name:
            error = {
                "message": f"The model '{model}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return json_response({"error": error}, 404)
        return json_response(card())

    async def parse(
        request: Request, to_native
    ) -> tuple[dict[str, Any], GenerateRequest] | Response:
        if not state.ready.is_set():
            return not_ready()
        if not request.headers.get("content-type", "").startswith("application/json"):
            return object_error("Content-Type must be application/json", 400, "Bad Request")
        try:
            body = read_json(request)
            if not isinstance(body, dict):
                raise RequestValidationError("Input should be a valid dictionary")
            native = to_native(body)
            native["lora_path"] = openai_lora_path(body, state.served_model_name)
            parsed = state.parse(native)
            if not state.scheduler.paused:  # else resolved once the pause ends (`submit`)
                await state.lora.resolve([item.lora_name for item in parsed.items])
            return body, parsed
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        except BadRequestError as exc:
            return bad_request(str(exc))

    async def finished(items) -> list[Sequence] | Response:
        """Run the items to the end: their sequences, or the error response."""
        try:
            async with state.scheduler.submit(items) as seqs:
                await wait_finished(seqs)
        except BadRequestError as exc:  # an adapter named during a pause, or unloaded since
            return bad_request(str(exc))
        failed = [s for s in seqs if s.error is not None]
        if failed:
            return object_error(failed[0].error or "generation failed", 500, "InternalServerError")
        return seqs

    # ----- completions ----------------------------------------------------------------------

    def completion_logprobs(seq: Sequence, echo: bool, start: int = 0) -> dict[str, Any]:
        """The choice's logprobs: of the prompt too with `echo`, of output tokens from `start`
        on (a stream sends each chunk's new tokens)."""
        lps: list[float | None] = []
        ids: list[int] = []
        tops: list[Any] = []
        if echo:
            lps += seq.input_logprobs or []
            ids += seq.item.input_ids[: len(lps)]
            tops += seq.input_top or [None] * len(lps)
        lps += seq.output_logprobs[start:]
        ids += seq.output_ids[start:]
        tops += (seq.output_top or [None] * len(seq.output_ids))[start:]
        k = seq.item.top_logprobs_num
        return {
            "text_offset": [-1] * len(ids),
            "token_logprobs": lps,
            "tokens": [state.token_text(t) for t in ids],
            "top_logprobs": [
                {state.token_text(t): lp for lp, t in row} if (row and k) else None for row in tops
            ],
        }

    def completion_choice(index: int, seq: Sequence, body: dict[str, Any]) -> dict[str, Any]:
        echo = bool(body.get("echo"))
        text = state.output_text(seq, final=True)
        if echo:  # the prompt as given: its special tokens are part of it
            text = state.decode(seq.item.input_ids, skip_special_tokens=False) + text
        reason, matched = _finish(seq)
        return {
            "index": index,
            "text": text,
            "logprobs": completion_logprobs(seq, echo) if seq.item.return_logprob else None,
            "finish_reason": reason,
            "matched_stop": matched,
            **token_ids_fields(seq, body),
        }

    @app.route("/v1/completions", methods=("POST",), cancel_on_disconnect=True)
    async def completions(request: Request) -> Response | StreamingResponse:
        parsed = await parse(request, completion_native)
        if isinstance(parsed, Response):
            return parsed
        body, req = parsed
        n = req.items[0].params.n
        header = {
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.served_model_name,
        }
        if req.stream:
            return StreamingResponse(bad_adapter_in_band(
                _stream_openai(state, req, body, header, chat=False,
                               logprobs=lambda seq, start: completion_logprobs(seq, False, start)),
                openai=True))  # fmt: skip
        seqs = await finished(req.items)
        if isinstance(seqs, Response):
            return seqs
        return json_response(
            {
                "id": f"cmpl-{seqs[0].rid}",
                **header,
                "choices": [completion_choice(i, s, body) for i, s in enumerate(seqs)],
                "usage": _usage(seqs, n),
                "metadata": {"weight_version": state.weight_version},
            }
        )

    # ----- chat -----------------------------------------------------------------------------

    def chat_logprobs(seq: Sequence, start: int = 0) -> dict[str, Any]:
        def entry(lp: float, tid: int) -> dict[str, Any]:
            token = state.token_text(tid)
            return {"token": token, "bytes": list(token.encode("utf-8")), "logprob": lp}

        tops = seq.output_top or [[] for _ in seq.output_ids]
        content = [
            {**entry(lp, tid), "top_logprobs": [entry(v, t) for v, t in top]}
            for lp, tid, top in zip(
                seq.output_logprobs[start:], seq.output_ids[start:], tops[start:], strict=True
            )
        ]
        return {"content": content}

    @app.route("/v1/chat/completions", methods=("POST",), cancel_on_disconnect=True)
    async def chat_completions(request: Request) -> Response | StreamingResponse:
        parsed = await parse(request, partial(chat_native, state))
        if isinstance(parsed, Response):
            return parsed
        body, req = parsed
        n = req.items[0].params.n
        header = {
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.served_model_name,
        }
        try:
            parser = (
                state.tool_parser()
                if wants_tool_calls(body, state.config.tool_call_parser)
                else None
            )
        except ValueError as exc:
            return object_error(str(exc), 500, "InternalServerError")
        if req.stream:
            chunk_header = {**header, "object": "chat.completion.chunk"}
            events = _stream_openai(state, req, body, chunk_header, chat=True,
                                    logprobs=chat_logprobs, parser=parser)  # fmt: skip
            return StreamingResponse(bad_adapter_in_band(events, openai=True))
        seqs = await finished(req.items)
        if isinstance(seqs, Response):
            return seqs
        choices = []
        for i, seq in enumerate(seqs):
            reason, matched = _finish(seq)
            content, calls = state.output_text(seq, final=True), []
            if parser is not None:
                content, calls = split_tool_calls(content, parser, f"call_{seq.rid}")
            message = {
                "role": "assistant",
                "content": content,
                "reasoning_content": None,
                "tool_calls": calls or None,
            }
            choice = {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(seq) if seq.item.return_logprob else None,
                "finish_reason": "tool_calls" if calls else reason,
                "matched_stop": matched,
            }
            ids = token_ids_fields(seq, body)
            if ids:
                choice["token_ids"] = ids["token_ids"]
            choices.append(choice)
        ids = token_ids_fields(seqs[0], body)
        return json_response(
            {
                "id": f"chatcmpl-{seqs[0].rid}",
                **header,
                "choices": choices,
                "usage": _usage(seqs, n),
                "metadata": {"weight_version": state.weight_version},
                **({"prompt_token_ids": ids["prompt_token_ids"]} if ids else {}),
            }
        )


async def _stream_openai(
    state: EngineState,
    req: GenerateRequest,
    body: dict[str, Any],
    header: dict[str, Any],
    *,
    chat: bool,
    logprobs=None,
    parser=None,
) -> AsyncIterator[bytes]:
    """OpenAI streaming: text deltas per choice, one chunk with the finish reason per choice.

    With a tool-call `parser` (chat), text from a call's mark on is held back and the calls go
    whole in the finishing chunk. With `return_token_ids`, each chunk carries its new sampled
    ids (`token_ids`) and a choice's first chunk the prompt's (`prompt_token_ids`: at the top
    level for chat, on the choice for completions, as vLLM sends them).
    """
    chunk_id = ("chatcmpl-" if chat else "cmpl-") + req.items[0].rid
    return_ids = bool(body.get("return_token_ids"))
    async with state.scheduler.submit(req.items) as seqs:
        sent_text = [""] * len(seqs)
        sent_tokens = [0] * len(seqs)
        async for index, seq, final in stream_sequences(seqs):
            if seq.error is not None:
                yield sse_event(
                    {
                        "error": {
                            "object": "error",
                            "message": seq.error,
                            "type": "InternalServerError",
                            "param": None,
                            "code": 500,
                        }
                    }
                )
                break
            text = state.output_text(seq, final=final)
            if not final and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                text = text.rstrip("\ufffd")
            calls: list[dict[str, Any]] = []
            if parser is not None and not final:
                text = streamable_text(text)
            elif parser is not None:
                calls = split_tool_calls(text, parser, f"call_{seq.rid}")[1]
                text = streamable_text(text) if calls else text
            delta_text = text[len(sent_text[index]) :] if text.startswith(sent_text[index]) else ""
            reason, matched = _finish(seq) if final else (None, None)
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": "tool_calls" if calls else reason,
                "matched_stop": matched,
            }
            first = not sent_text[index] and not sent_tokens[index]
            top: dict[str, Any] = {}
            if return_ids:
                choice["token_ids"] = list(seq.output_ids[sent_tokens[index] :])
                if first:
                    where = top if chat else choice
                    where["prompt_token_ids"] = list(seq.item.input_ids)
            if chat:
                delta: dict[str, Any] = {"content": delta_text}
                if first:
                    delta["role"] = "assistant"
                if calls:
                    delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls)]
                choice["delta"] = delta
                if seq.item.return_logprob:
                    choice["logprobs"] = logprobs(seq, sent_tokens[index])
            else:
                choice["text"] = delta_text
                choice["logprobs"] = (
                    logprobs(seq, sent_tokens[index]) if seq.item.return_logprob else None
                )
            sent_text[index] += delta_text
            sent_tokens[index] = len(seq.output_ids)
            yield sse_event({"id": chunk_id, **header, "choices": [choice], **top})
        else:
            options = body.get("stream_options") or {}
            if options.get("include_usage"):
                usage = _usage(seqs, req.items[0].params.n)
                yield sse_event({"id": chunk_id, **header, "choices": [], "usage": usage})
    yield SSE_DONE
