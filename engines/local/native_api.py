"""SGLang's native HTTP routes on the local engine (sglang_protocol.md §1–3, §7 items 1–8)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import trio

from .asgi import (
    SSE_DONE,
    App,
    Request,
    Response,
    StreamingResponse,
    error_response,
    json_response,
    object_error,
    sse_event,
    text_response,
)
from .memory_occupation import memory_usage, parse_tags
from .params import GenerateItem
from .pause_lease import MAX_LEASE_S
from .route_helpers import (
    as_bool,
    bad_adapter_in_band,
    not_ready,
    read_body,
    read_json,
    stream_sequences,
    wait_finished,
)
from .sampling_params import BadRequestError, RequestValidationError, SamplingParams
from .scheduler import PauseMode
from .state import VERSION, EngineState

logger = logging.getLogger(__name__)


def health_check_timeout_s() -> float:
    """SGLang's `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s): how long `/health_generate` waits."""
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


_FLUSH_NOTE = (
    "Please check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)


def register_native_routes(app: App, state: EngineState) -> None:
    @app.route("/health")
    async def health(request: Request) -> Response:
        return Response(200 if state.ready.is_set() else 503, b"", "")

    @app.route("/health_generate")
    async def health_generate(request: Request) -> Response:
        if not state.ready.is_set():
            return Response(503, b"", "")
        key = state.config.api_key
        if key and not App.authorized(request, key):
            # Open to anyone (SGLang exempts /health*), so it must not cost a model step: a
            # caller without the key learns what /health says.
            return Response(200, b"", "")
        scheduler = state.scheduler
        if scheduler.busy and not scheduler.paused:  # generating: alive (SGLang: any output)
            return Response(200, b"", "")
        item = GenerateItem(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, top_k=1),
            return_logprob=False,
            logprob_start_len=0,
            top_logprobs_num=0,
            return_text_in_logprobs=False,
        )
        # As in SGLang 0.5.23, the probe request queues behind a pause like any request, so a
        # paused engine answers 503 after the timeout.
        with trio.move_on_after(health_check_timeout_s()):
            try:
                async with scheduler.submit([item], lock=False) as seqs:
                    await wait_finished(seqs)
                    if seqs[0].error is None:
                        return Response(200, b"", "")
            except BadRequestError:  # memory released, or no weights since (colocated): 503
                pass
        return Response(503, b"", "")

    async def model_info(request: Request) -> Response:
        return json_response(
            {
                "model_path": state.model_path,
                "tokenizer_path": state.config.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": state.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": state.model_type,
                "architectures": state.architectures,
            }
        )

    async def server_info(request: Request) -> Response:
        info = state.config.server_args()
        info["model_path"] = state.model_path
        scheduler = state.scheduler
        limits = state.limits
        if limits is not None:
            info["max_total_num_tokens"] = limits.context_len * state.config.max_running_requests
            info["max_req_input_len"] = limits.context_len - 1
            info["context_length"] = limits.context_len
        else:
            info["max_total_num_tokens"] = 0
        info["internal_states"] = [
            {
                "last_gen_throughput": scheduler.last_gen_throughput if scheduler else 0.0,
                "num_running_reqs": len(scheduler.running) if scheduler else 0,
                "num_waiting_reqs": len(scheduler.waiting) if scheduler else 0,
                # arrived during a pause, held in front of the scheduler (not SGLang's key)
                "num_held_reqs": len(scheduler.held) if scheduler else 0,
                "paused": bool(scheduler and scheduler.paused),
                "memory_usage": memory_usage(scheduler.runner) if scheduler else {},
            }
        ]
        info["version"] = VERSION
        info["weight_version"] = state.weight_version  # the current one, as /model_info says
        return json_response(info)

    for path in ("/get_model_info", "/model_info"):
        app.route(path)(model_info)
    for path in ("/get_server_info", "/server_info"):
        app.route(path)(server_info)

    @app.route("/get_weight_version")
    async def get_weight_version(request: Request) -> Response:
        return object_error(
            "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use "
            "'/model_info' instead.",
            404,
        )

    @app.route("/generate", methods=("POST", "PUT"), cancel_on_disconnect=True)
    async def generate(request: Request) -> Response | StreamingResponse:
        if not state.ready.is_set():
            return not_ready()
        try:
            parsed = state.parse(read_json(request))
            if not state.scheduler.paused:  # else resolved once the pause ends (`submit`)
                await state.lora.resolve([item.lora_name for item in parsed.items])
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        except BadRequestError as exc:
            return error_response(str(exc))
        if parsed.stream:
            events = _stream_generate(state, parsed.items, parsed.is_batch)
            return StreamingResponse(bad_adapter_in_band(events, openai=False))
        try:
            async with state.scheduler.submit(parsed.items) as seqs:
                await wait_finished(seqs)
        except BadRequestError as exc:  # an adapter named during a pause, or unloaded since
            return error_response(str(exc))
        failed = [s for s in seqs if s.error is not None]
        if failed:
            return object_error(failed[0].error or "generation failed", 500)
        records = [state.generate_record(s) for s in seqs]
        return json_response(records if parsed.is_batch else records[0])

    @app.route("/abort_request", methods=("POST",), admin=True)
    async def abort_request(request: Request) -> Response:
        try:
            body = read_json(request)
            if not isinstance(body, dict):
                raise RequestValidationError("Input should be a valid dictionary")
        except RequestValidationError as exc:
            return error_response(str(exc))
        if state.scheduler is not None:
            state.scheduler.abort(body.get("rid") or None, abort_all=bool(body.get("abort_all")))
        return Response(200, b"", "")

    @app.route("/pause_generation", methods=("POST",), admin=True)
    async def pause_generation(request: Request) -> Response:
        try:
            body = read_body(request)
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        mode: PauseMode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return error_response(f"mode must be one of abort, retract, in_place; got {mode!r}.")
        lease_s = body.get("lease_s")  # the project's extension (pause_lease.py); SGLang: none
        if lease_s is not None and (not isinstance(lease_s, int | float) or isinstance(lease_s, bool)
                                    or not 0 < lease_s <= MAX_LEASE_S):  # fmt: skip
            return error_response(
                f"lease_s must be a number in (0, {MAX_LEASE_S:g}]; got {lease_s!r}."
            )
        if state.scheduler is None:
            return not_ready()
        if lease_s is not None and state.scheduler.paused and state.pause_lease.held:
            state.pause_lease.hold(lease_s)  # a renewal: held requests stay held
        else:
            await state.scheduler.pause(mode)
            if lease_s is not None:
                state.pause_lease.hold(lease_s)
            else:
                state.pause_lease.release()
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    @app.route("/continue_generation", methods=("POST",), admin=True)
    async def continue_generation(request: Request) -> Response:
        try:
            read_body(request)
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        if state.scheduler is None:
            return not_ready()
        state.scheduler.resume()
        state.pause_lease.release()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    @app.route("/flush_cache", methods=("GET", "POST"), admin=True)
    async def flush_cache(request: Request) -> Response:
        # SGLang 0.5.23: refused while requests run, or wait outside a pause
        if state.scheduler is not None and not await state.scheduler.flush_cache():
            return text_response("Cache not flushed.\n" + _FLUSH_NOTE, 400)
        return text_response("Cache flushed.\n" + _FLUSH_NOTE)

    @app.route("/update_weights_from_disk", methods=("POST",), admin=True)
    async def update_weights_from_disk(request: Request) -> Response:
        try:
            body = read_json(request)
            path = body.get("model_path") if isinstance(body, dict) else None
            if not isinstance(path, str) or not path:
                raise RequestValidationError("model_path: Field required (a non-empty string)")
            version = body.get("weight_version")
            for name in ("weight_version", "load_format"):
                if body.get(name) is not None and not isinstance(body[name], str):
                    raise RequestValidationError(f"{name}: Input should be a valid string")
            abort_all = as_bool(body, "abort_all_requests", False)
            flush = as_bool(body, "flush_cache", True)
            for name in ("is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph"):
                as_bool(body, name, False)
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        if state.scheduler is None:
            return not_ready()
        refusal = _outside_weights_root(path, state.config.weights_root)
        if refusal is not None:
            body = {"success": False, "message": refusal, "num_paused_requests": 0}
            return json_response(body, 400)
        success, message = await state.scheduler.update_weights(
            path,  # relative: resolved in this process's cwd, as SGLang does
            version,
            abort_all_requests=abort_all,
            flush_cache=flush,
        )
        body = {"success": success, "message": message, "num_paused_requests": 0}
        return json_response(body, 200 if success else 400)

    @app.route("/update_weight_version", methods=("POST",), admin=True)
    async def update_weight_version(request: Request) -> Response:
        try:
            body = read_json(request)
            version = body.get("new_version") if isinstance(body, dict) else None
            if not isinstance(version, str) or not version:
                raise RequestValidationError("new_version: Field required (a non-empty string)")
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        if state.scheduler is None:
            return not_ready()
        if body.get("abort_all_requests", True):
            state.scheduler.abort(abort_all=True)
        state.scheduler.weight_version = version
        return json_response(
            {
                "success": True,
                "message": f"Weight version updated to {version}",
                "new_version": version,
            }
        )

    def memory_route(release: bool):  # memory_occupation.py
        async def route(request: Request) -> Response:
            if not state.ready.is_set():
                return not_ready()
            scheduler = state.scheduler
            try:
                tags = parse_tags(read_json(request) if request.body else {})
            except (BadRequestError, RequestValidationError) as exc:
                return error_response(str(exc))
            if release and scheduler.busy:
                return error_response("the engine is not idle: requests are running or queued; "
                                      "finish or abort them before releasing its memory")  # fmt: skip
            if release:  # refused from this idle check on, not only once it is done
                with scheduler.memory.releasing_now(tags):
                    await scheduler.run_on_model_thread(scheduler.memory.release, tags)
            else:
                await scheduler.run_on_model_thread(scheduler.memory.resume, tags)
            return json_response(None)

        return route

    for path, release in (("/release_memory_occupation", True),
                          ("/resume_memory_occupation", False)):  # fmt: skip
        app.route(path, methods=("GET", "POST"), admin=True)(memory_route(release))


def _outside_weights_root(path: str, root: str | None) -> str | None:
    """Why `path` may not be loaded (`--weights-root`), or None when it may."""
    if root is None:
        return None
    # realpath: `..` and symlinks cannot lead out of the root
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        return (
            f"Failed to update weights: {path} is outside the weights root {root} "
            "(--weights-root); the old weights stay."
        )
    return None


async def _stream_generate(
    state: EngineState, items: list[GenerateItem], is_batch: bool
) -> AsyncIterator[bytes]:
    incremental = state.config.incremental_streaming_output
    async with state.scheduler.submit(items) as seqs:
        sent_tokens = [0] * len(seqs)
        sent_text = [""] * len(seqs)
        async for index, seq, final in stream_sequences(seqs):
            if seq.error is not None:
                yield sse_event({"error": {"message": seq.error}})
                break
            record = state.generate_record(seq, final=final)
            if incremental:
                record = _delta(record, sent_tokens[index], sent_text[index])
                sent_tokens[index] = len(seq.output_ids)
                sent_text[index] += record["text"]
            if is_batch:
                record["index"] = index
            yield sse_event(record)
    yield SSE_DONE


def _delta(record: dict[str, Any], tokens_sent: int, text_sent: str) -> dict[str, Any]:
    """Incremental streaming: output ids, text and output logprobs since the last chunk."""
    record["output_ids"] = record["output_ids"][tokens_sent:]
    text = record["text"]
    record["text"] = text[len(text_sent) :] if text.startswith(text_sent) else text
    meta = record["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = meta[key][tokens_sent:]
    return record
