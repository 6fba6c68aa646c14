"""The HTTP routes of `rollouts tinker-serve`: what the `tinker` 0.38.0 SDK calls, on the
project's own ASGI layer (engines/local/asgi.py).

Replies: a refused request is answered 4xx with `{"error": ..., "category": "user"}` (the SDK
raises it at once as a `BadRequestError`/`NotFoundError` carrying that text); a request that
fails later fails its future (`retrieve_future` answers `{"error", "category"}`, which the SDK
raises as `RequestFailedError`). Never a 5xx for the caller's input: the SDK retries 5xx for
minutes.
"""

from __future__ import annotations

import functools
import math
import uuid
from collections import Counter
from typing import Any

from engines.local.asgi import App, Request, Response, json_response
from plumbing.errors import EngineError
from rollouts.tinker_server.losses import check_request
from rollouts.tinker_server.service import TinkerService
from rollouts.tinker_server.wire import (
    PROTO,
    SampledSeq,
    TinkerRequestError,
    decode_body,
    encode_forward_backward_output,
    encode_sample_response,
    parse_forward_backward,
)

MAX_BODY_BYTES = 512 * 1024 * 1024
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # API keys are accepted as they are (any `tml-...` key)
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": True,
    "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def _refusal(exc: TinkerRequestError) -> Response:
    return json_response({"error": exc.message, "category": exc.category}, exc.status)


def _route(app: App, path: str, methods=("POST",), *, counts: Counter | None = None):
    """Register a handler whose TinkerRequestError (or malformed JSON) becomes a 4xx answer;
    `counts[path]` counts its requests."""

    def register(fn):
        @functools.wraps(fn)
        async def handler(request: Request) -> Response:
            if counts is not None:
                counts[path] += 1
            try:
                return await fn(request)
            except TinkerRequestError as exc:
                return _refusal(exc)
            except (ValueError, KeyError, TypeError) as exc:
                return _refusal(TinkerRequestError(f"{request.path}: malformed request: {exc!r}"))

        return app.route(path, methods)(handler)

    return register


def _tokens(model_input: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(model_input.get("chunks", [])):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise TinkerRequestError(f"prompt.chunks[{i}] is a {chunk.get('type')} chunk: this "
                                     "server takes text (EncodedTextChunk) only")  # fmt: skip
        tokens += [int(t) for t in chunk["tokens"]]
    return tokens


def _engine_params(sp: dict[str, Any], n: int) -> dict[str, Any]:
    params: dict[str, Any] = {"n": n, "temperature": float(sp.get("temperature", 1.0)),
                              "top_p": float(sp.get("top_p", 1.0)),
                              "top_k": int(sp.get("top_k", -1))}  # fmt: skip
    if sp.get("max_tokens") is not None:
        params["max_new_tokens"] = int(sp["max_tokens"])
    if sp.get("seed") is not None:
        params["sampling_seed"] = int(sp["seed"])
    stop = sp.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    elif isinstance(stop, list) and not stop:
        params["ignore_eos"] = True  # Tinker: [] disables every stop, EOS included
    elif isinstance(stop, list) and all(isinstance(s, int) for s in stop):
        params["stop_token_ids"] = stop
    elif isinstance(stop, list):
        params["stop"] = stop
    return params


async def _sample(service: TinkerService, adapter: str | None, prompt: list[int],
                  params: dict[str, Any], want_prompt: bool, start: int) -> bytes:  # fmt: skip
    """One `asample` on the engine: n samples (each its own seed when seeded, not n copies),
    logprobs, and the prompt's from position `start` on; a `SampleResponse` protobuf."""
    n = params["n"]
    prompts, per_sample = [prompt], params
    if "sampling_seed" in params and n > 1:
        prompts = [prompt] * n
        per_sample = [{**params, "n": 1, "sampling_seed": params["sampling_seed"] + i}
                      for i in range(n)]  # fmt: skip
    try:
        # the engine's first prompt logprob (at logprob_start_len) is always None (SGLang's
        # layout), so it is asked to start one position earlier
        results = await service.engine.generate_batch(
            prompts, per_sample, return_logprob=True,
            logprob_start_len=max(0, start - 1) if want_prompt else None, lora_path=adapter)  # fmt: skip
    except EngineError as exc:
        if exc.status is not None and 400 <= exc.status < 500:  # the caller's parameters
            raise TinkerRequestError(f"the engine refused the sample: {exc}") from None
        raise
    seqs = []
    for r in results:
        if r.aborted:
            raise TinkerRequestError(f"the engine aborted the sample: {r.finish_reason}", 500,
                                     "server")  # fmt: skip
        reason = "length" if r.finish_reason.type == "length" else "stop"
        seqs.append(SampledSeq(list(r.output_ids), list(r.output_logprobs or []), reason))
    prompt_lp = None
    if want_prompt and results and results[0].input_logprobs is not None:
        got = list(results[0].input_logprobs)
        scored = got[start - len(prompt) :] if start else got
        prompt_lp = [math.nan] * start + [math.nan if v is None else v for v in scored]
    return encode_sample_response(seqs, prompt_lp)


def build_app(service: TinkerService) -> App:
    app = App(max_body_bytes=MAX_BODY_BYTES)
    route = functools.partial(_route, counts=service.request_counts)

    @route(app, "/api/v1/healthz", ("GET",))
    async def healthz(request: Request) -> Response:
        return json_response({"status": "ok"})

    @route(app, "/api/v1/get_server_capabilities", ("GET",))
    async def capabilities(request: Request) -> Response:
        return json_response({"supported_models": [
            {"model_name": name, "trainable": True, "sampleable": True}
            for name in sorted(service.names, key=lambda n: n != service.base_name)]})  # fmt: skip

    @route(app, "/api/v1/client/config")
    async def client_config(request: Request) -> Response:
        return json_response({**CLIENT_CONFIG, **service.client_config})

    @route(app, "/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> Response:
        return json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    @route(app, "/api/v1/create_session")
    async def create_session(request: Request) -> Response:
        session_id = uuid.uuid4().hex
        service.sessions.add(session_id)
        return json_response({"type": "create_session", "session_id": session_id})

    @route(app, "/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        return json_response({"type": "session_heartbeat"})

    @route(app, "/api/v1/sessions/{id}")  # the router matches a trailing {id}: "<id>/finish"
    async def finish_session(request: Request) -> Response:
        # ServiceClient.close(): the session ends (its heartbeats stop); the models it made stay
        session_id, _, action = request.path_params["id"].partition("/")
        if action != "finish":
            raise TinkerRequestError(f"no route {request.path}", 404)
        service.sessions.discard(session_id)
        return json_response(None)

    @route(app, "/api/v1/telemetry")
    async def telemetry(request: Request) -> Response:
        return json_response({"status": "accepted"})  # accepted and dropped

    @route(app, "/api/v1/create_model")
    async def create_model(request: Request) -> Response:
        body = request.json()
        service.check_base_model(body["base_model"])
        lora = body.get("lora_config")
        model_id = f"{body['session_id']}:train:{int(body['model_seq_id'])}"
        rank = None if lora is None else int(lora["rank"])

        async def job() -> dict[str, Any]:
            await service.create_model(model_id, body["base_model"], rank,
                                       None if lora is None else lora.get("seed"))  # fmt: skip
            return {"model_id": model_id, "type": "create_model"}

        return json_response(service.start(job, model_id=model_id))

    @route(app, "/api/v1/get_info")
    async def get_info(request: Request) -> Response:
        model_id = request.json()["model_id"]
        model = service.model(model_id)
        rank = model.spec.lora_rank
        config = getattr(model.backend.model, "config", None)
        arch = (getattr(config, "architectures", None) or [None])[0]
        return json_response({
            "type": "get_info", "model_id": model_id, "is_lora": rank is not None,
            "lora_rank": rank, "model_name": model.spec.base_model,
            "model_data": {"arch": arch, "model_name": model.spec.base_model,
                           "tokenizer_id": service.tokenizer_id},
        })  # fmt: skip

    @route(app, "/api/v1/forward_backward")
    async def forward_backward(request: Request) -> Response:
        req = parse_forward_backward(decode_body(request.body, request.headers))
        model = service.model(req.model_id)
        try:
            check_request(req.loss_fn, req.data, vocab_size=model.vocab_size,
                          max_length=model.max_length, config=req.config)  # fmt: skip
        except TinkerRequestError as exc:
            # refused in its turn: the seq_id is used up, so the requests behind it still run
            error = exc

            async def refused() -> None:
                raise error

            return json_response(service.submit(req.model_id, req.seq_id, refused))

        async def job() -> bytes:
            outputs, metrics = await model.forward_backward(req.data, req.loss_fn, req.config,
                                                            req.forward_only)  # fmt: skip
            return encode_forward_backward_output(outputs, metrics)

        return json_response(service.submit(req.model_id, req.seq_id, job))

    @route(app, "/api/v1/optim_step")
    async def optim_step(request: Request) -> Response:
        body = request.json()
        model = service.model(body["model_id"])
        params = body.get("adam_params") or body.get("optim_params")
        if params is None or params.get("type", "adamw") not in ("adamw", "adam"):
            raise TinkerRequestError(f"optim_step: only AdamParams are served, got {body!r}")

        async def job() -> dict[str, Any]:
            return {"metrics": await model.optim_step(params)}

        return json_response(service.submit(body["model_id"], body.get("seq_id"), job))

    @route(app, "/api/v1/save_weights")
    async def save_weights(request: Request) -> Response:
        body = request.json()
        model = service.model(body["model_id"])
        name = service.check_name(body.get("path") or f"step-{model.backend.step}", "path")

        async def job() -> dict[str, Any]:
            await model.save_state(name)
            return {"path": service.state_path(body["model_id"], name), "type": "save_weights"}

        return json_response(service.submit(body["model_id"], body.get("seq_id"), job))

    @route(app, "/api/v1/load_weights")
    async def load_weights(request: Request) -> Response:
        body = request.json()
        directory, spec = service.resolve_state(body["path"])
        optimizer = bool(body.get("optimizer"))
        if body.get("model_id") is not None:  # onto an existing model, in its order
            model_id = body["model_id"]
            model = service.model(model_id)
            if model.spec.lora_rank != spec.lora_rank:
                raise TinkerRequestError(f"{body['path']} has LoRA rank {spec.lora_rank}, the "
                                         f"model {model.spec.lora_rank}")  # fmt: skip

            async def onto() -> dict[str, Any]:
                await model.load_state(directory, optimizer=optimizer)
                return {"path": body["path"], "model_id": model_id, "type": "load_weights"}

            return json_response(service.submit(model_id, body.get("seq_id"), onto))
        model_id = f"{body['session_id']}:train:{int(body['model_seq_id'])}"
        service.check_base_model(body.get("base_model"))

        async def create_and_load() -> dict[str, Any]:
            model = await service.create_model(model_id, service.base_name, spec.lora_rank,
                                               spec.seed)  # fmt: skip
            await model.load_state(directory, optimizer=optimizer)
            return {"path": body["path"], "model_id": model_id, "type": "load_weights"}

        return json_response(service.start(create_and_load, model_id=model_id))

    @route(app, "/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> Response:
        body = request.json()
        service.model(body["model_id"])
        name = body.get("path")
        if name is not None:
            service.check_name(name, "path")
        session_id = body["model_id"].split(":train:")[0]

        async def job() -> dict[str, Any]:
            return await service.save_for_sampler(body["model_id"], session_id,
                                                  body.get("sampling_session_seq_id"), name)  # fmt: skip

        return json_response(service.submit(body["model_id"], body.get("seq_id"), job))

    @route(app, "/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> Response:
        body = request.json()
        sampler_id = service.create_sampling_session(
            body["session_id"], int(body["sampling_session_seq_id"]), body.get("base_model"),
            body.get("model_path"))  # fmt: skip
        return json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})

    @route(app, "/api/v1/samplers/{id}", ("GET",))
    async def get_sampler(request: Request) -> Response:
        sampler = service.sampler(request.path_params["id"])
        return json_response({"sampler_id": request.path_params["id"],
                              "base_model": service.base_name, "model_path": sampler.model_path})  # fmt: skip

    @route(app, "/api/v1/asample")
    async def asample(request: Request) -> Response:
        body = request.json()
        sampler = service.sampler(body.get("sampling_session_id"))
        if body.get("sampling_session_id") is None:
            service.check_base_model(body.get("base_model"))
        prompt = _tokens(body["prompt"])
        n = int(body.get("num_samples", 1))
        params = _engine_params(body.get("sampling_params") or {}, n)
        want_prompt = bool(body.get("prompt_logprobs"))
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and not 1 <= int(last_n) <= len(prompt) - 1:
            raise TinkerRequestError(f"prompt_logprobs_last_n {last_n} is not in [1, "
                                     f"{len(prompt) - 1}] (the prompt has {len(prompt)} tokens)")  # fmt: skip
        start = 0 if last_n is None else len(prompt) - int(last_n)  # the first position scored

        job = functools.partial(_sample, service, sampler.adapter, prompt, params,
                                want_prompt, start)  # fmt: skip
        ids = [f"{body.get('sampling_session_id')}:{body.get('seq_id')}:{i}" for i in range(n)]
        return json_response(service.start(job, sample_sequence_ids=ids))

    @route(app, "/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        request_id = request.json()["request_id"]
        entry = await service.table.wait(request_id)
        if entry is None:
            return json_response({"type": "try_again", "request_id": request_id,
                                  "queue_state": "active"})  # fmt: skip
        if entry.error is not None:
            return json_response({"error": entry.error.message, "category": entry.error.category})
        if isinstance(entry.result, bytes):
            return Response(200, entry.result, PROTO)
        return json_response(entry.result)

    @route(app, "/api/v1/weights_info")
    async def weights_info(request: Request) -> Response:
        _, spec = service.resolve_state(request.json()["tinker_path"])
        return json_response({"base_model": spec.base_model, "is_lora": spec.lora_rank is not None,
                              "lora_rank": spec.lora_rank})  # fmt: skip

    @route(app, "/api/v1/training_runs/{id}", ("GET",))
    async def checkpoints(request: Request) -> Response:
        model_id, _, rest = request.path_params["id"].partition("/")
        if rest != "checkpoints":
            raise TinkerRequestError(f"{request.path}: only .../checkpoints is served", 404)
        root = service.run_root / model_id / "weights"
        found = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        return json_response({"checkpoints": [
            {"checkpoint_id": f"weights/{p.name}", "checkpoint_type": "training",
             "time": _mtime(p), "tinker_path": service.state_path(model_id, p.name)}
            for p in found]})  # fmt: skip

    return app


def _mtime(path) -> str:
    import datetime

    stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime, tz=datetime.UTC)
    return stamp.isoformat()
