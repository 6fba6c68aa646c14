"""What every route module of the local engine shares: reading bodies, readiness, waiting on
sequences, errors that arrive mid-stream.

Why a module of its own: the native, LoRA and OpenAI routes all use these, and before they sat
in native_api.py, which itself needs a LoRA helper, so the two route modules imported each
other. Only asgi.py, sampling_params.py and sequence.py sit below it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from .asgi import SSE_DONE, Request, Response, object_error, sse_event
from .sampling_params import BadRequestError, RequestValidationError
from .sequence import Sequence

_MISSING_BODY = "[{'type': 'missing', 'loc': ('body',), 'msg': 'Field required', 'input': None}]"
_PYDANTIC_TRUE = {"1", "on", "t", "true", "y", "yes"}
_PYDANTIC_FALSE = {"0", "off", "f", "false", "n", "no"}


def read_body(request: Request) -> dict[str, Any]:
    """A route whose SGLang handler takes a request object: no body is FastAPI's 400."""
    if not request.body.strip():
        raise RequestValidationError(_MISSING_BODY)
    body = read_json(request)
    if not isinstance(body, dict):
        raise RequestValidationError("Input should be a valid dictionary or object")
    return body


def as_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    """Pydantic's lax bool (SGLang validates the update body with it): true/false, 0/1 and
    their usual strings; anything else is a 400."""
    value = body.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _PYDANTIC_TRUE | _PYDANTIC_FALSE:
        return value.lower() in _PYDANTIC_TRUE
    raise RequestValidationError(f"{name}: Input should be a valid boolean, got {value!r}")


def not_ready() -> Response:
    return object_error("The server is starting up (loading the model).", 503)


def read_json(request: Request) -> Any:
    try:
        return request.json()
    except (ValueError, RecursionError) as exc:  # bad JSON, a 5000-digit int, deep nesting
        raise RequestValidationError(f"JSON decode error: {exc}") from None


async def wait_finished(seqs: list[Sequence]) -> None:
    for seq in seqs:
        while not seq.finished:
            await seq.changed.wait()


async def stream_sequences(seqs: list[Sequence]) -> AsyncIterator[tuple[int, Sequence, bool]]:
    """Yield (index, seq, final) whenever a sequence has new tokens or finished."""
    sent = [0] * len(seqs)
    pending = list(range(len(seqs)))
    while pending:
        head = seqs[pending[0]]
        event = head.changed
        if not head.finished and len(head.output_ids) == sent[pending[0]]:
            await event.wait()
        for i in list(pending):
            seq = seqs[i]
            if seq.finished:
                pending.remove(i)
                yield i, seq, True
            elif len(seq.output_ids) > sent[i]:
                sent[i] = len(seq.output_ids)
                yield i, seq, False


async def bad_adapter_in_band(
    events: AsyncIterator[bytes], *, openai: bool
) -> AsyncIterator[bytes]:
    """A stream whose adapter turned out unknown once a pause ended (names are resolved then,
    see `Scheduler.submit`): the 400 goes in-band, as SGLang streams its errors."""
    try:
        async for event in events:
            yield event
    except BadRequestError as exc:
        error: dict[str, Any] = {"message": str(exc)}
        if openai:
            error = {"object": "error", "message": str(exc), "type": "BadRequestError",
                     "param": None, "code": 400}  # fmt: skip
        yield sse_event({"error": error})
        yield SSE_DONE
