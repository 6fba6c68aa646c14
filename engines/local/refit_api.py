"""SGLang's distributed refit routes on the local engine: weights broadcast by the trainer.

The receiving side of `engines.weight_transport: distributed` (engines/refit.py is the sending
side), as SGLang 0.5.23 implements it (`http_server.py`, `io_struct.py`,
`managers/scheduler_components/weight_updater.py`, `model_runner_components/weight_updater.py`):
- `/init_weights_update_group {master_address, master_port, rank_offset, world_size,
  group_name, backend}` joins a process group of its own (plumbing/process_group.py) as rank
  `rank_offset`; gloo on CPU, NCCL when the engine runs on CUDA (`backend` is passed through).
  A failure answers 400 `Failed to initialize custom process group: …`. A name already joined
  is left first (a restarted trainer re-forms its group under the same name).
- `/begin_weight_update` … `/end_weight_update` bracket an update; a second begin, an end
  without a begin, and an `/update_weights_from_distributed` outside the session answer 400
  with SGLang's messages.
- `/update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
  abort_all_requests, weight_version, load_format}` receives the tensors rank 0 broadcasts
  (one broadcast per tensor, or one per bucket with `load_format: "flattened_bucket"`) off the
  model thread, and stages them. An unknown group answers 400 `Failed to receive weights:
  Group … not in […]`.
- Departure from SGLang (refit_session.py): the staged buckets are loaded at
  `/end_weight_update`, all at once (every name and shape checked first, then copied between
  two model steps under the update rules of scheduler_control.py: paused, at once; else after
  in-flight requests), with the version a bucket carried. A failed or refused bucket, a new
  group, the session's group destroyed, or a session idle past the group's deadline abandons
  it: nothing loaded, version unchanged, session closed (the end that follows answers 400).
- `/destroy_weights_update_group {group_name}` leaves the group; an unknown one answers 400
  `The group to be destroyed does not exist.`

Every wait is bounded by `--weight-group-timeout` (gloo's timeout on the group).
Buckets received over gloo are staged in host memory (its wire is there; the load copies them
to the engine's device), over NCCL on the engine's GPU.
Not covered: SGLang's `selector` (no draft model here; only validated).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from .asgi import App, Request, Response, json_response, object_error
from .refit_session import RefitSession
from .route_helpers import as_bool, not_ready, read_body
from .sampling_params import RequestValidationError
from .state import EngineState

logger = logging.getLogger(__name__)

_OUTSIDE = ("update_weights_from_distributed must run between begin_weight_update() and "
            "end_weight_update()")  # fmt: skip
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "int8", "bool")


def register_refit_routes(app: App, state: EngineState) -> None:
    groups: dict[str, Any] = {}
    backends: dict[str, str] = {}  # each group's backend: where its buckets are received
    timeout_s = state.config.weight_group_timeout_s
    session = RefitSession(timeout_s)

    def answer(success: bool, message: str) -> Response:
        return json_response({"success": success, "message": message}, 200 if success else 400)

    @app.route("/init_weights_update_group", methods=("POST",), admin=True)
    async def init_group(request: Request) -> Response:
        try:
            body = read_body(request)
            address = _field(body, "master_address", str)
            port, offset = _field(body, "master_port", int), _field(body, "rank_offset", int)
            world = _field(body, "world_size", int)
            name = _field(body, "group_name", str, "weight_update_group")
            backend = _field(body, "backend", str, "nccl")
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        if not state.ready.is_set():
            return not_ready()
        if not name:
            return answer(False, "Group name cannot be empty")
        if backend == "nccl" and not state.config.device.startswith("cuda"):
            # SGLang would wait for every rank first and fail after; nothing can come of it
            return answer(False, "Failed to initialize custom process group: the nccl backend "
                                 f"needs CUDA and this engine runs on {state.config.device}; "
                                 "use backend gloo.")  # fmt: skip
        # torch only now: importing the engine's package must not load it (`rollouts serve -h`)
        from plumbing.process_group import destroy_process_group, init_custom_process_group

        session.group_formed(name)  # an update under way has lost its sender
        if name in groups:  # a restarted trainer's group of the same name: leave the old one
            await trio.to_thread.run_sync(destroy_process_group, groups.pop(name))
        logger.info("init custom process group: master_address=%s, master_port=%s, "
                    "rank_offset=%s, world_size=%s, group_name=%s, backend=%s",
                    address, port, offset, world, name, backend)  # fmt: skip
        try:
            groups[name] = await trio.to_thread.run_sync(lambda: init_custom_process_group(
                backend=backend, master_address=address, master_port=port, world_size=world,
                rank=offset, group_name=name, timeout_s=timeout_s))  # fmt: skip
            backends[name] = backend
        except Exception as exc:  # SGLang answers any failure as a 400
            message = f"Failed to initialize custom process group: {exc}."
            logger.error(message)
            return answer(False, message)
        return answer(True, "Succeeded to initialize custom process group.")

    @app.route("/destroy_weights_update_group", methods=("POST",), admin=True)
    async def destroy_group(request: Request) -> Response:
        try:
            name = _field(read_body(request), "group_name", str, "weight_update_group")
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        if name not in groups:
            return answer(False, "The group to be destroyed does not exist.")
        from plumbing.process_group import destroy_process_group

        session.group_destroyed(name)
        try:
            await trio.to_thread.run_sync(destroy_process_group, groups.pop(name))
        except Exception as exc:
            return answer(False, f"Failed to destroy custom process group: {exc}.")
        return answer(True, "Succeeded to destroy custom process group.")

    @app.route("/begin_weight_update", methods=("POST",), admin=True)
    async def begin(request: Request) -> Response:
        try:
            selector = _field(read_body(request), "selector", str, "all")
            if selector not in ("target", "draft", "all"):
                raise RequestValidationError(f"selector: Input should be 'target', 'draft' or "
                                             f"'all', got {selector!r}")  # fmt: skip
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        refusal = session.begin()
        return answer(refusal is None, refusal or "Success")

    @app.route("/end_weight_update", methods=("POST",), admin=True)
    async def end(request: Request) -> Response:
        try:
            read_body(request)
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        if state.scheduler is None:
            return not_ready()
        finished = session.finish()
        if isinstance(finished, str):
            return answer(False, finished)
        tensors, version, flush, abort_all = finished
        if not tensors and version is None:
            return answer(True, "Success")
        runner = state.scheduler.runner
        success, message = await state.scheduler.update_weights_with(
            lambda: runner.load_tensors(tensors), version, abort_all_requests=abort_all,
            flush_cache=flush, done="Success.")  # fmt: skip
        return answer(success, message)

    @app.route("/update_weights_from_distributed", methods=("POST",), admin=True)
    async def update(request: Request) -> Response:
        try:
            body = read_body(request)
            names, dtypes, shapes = _tensor_specs(body)
            name = _field(body, "group_name", str, "weight_update_group")
            version = _field(body, "weight_version", str, None)
            load_format = _field(body, "load_format", str, None)
            flush = as_bool(body, "flush_cache", True)
            abort_all = as_bool(body, "abort_all_requests", False)
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        if state.scheduler is None:
            return not_ready()
        if not session.open:
            return answer(False, _OUTSIDE)
        if name not in groups:
            message = (f"Failed to receive weights: Group {name} not in {list(groups)}. Please "
                       "call `init_weights_update_group` first.")  # fmt: skip
            session.abandon(message)
            return answer(False, message)
        group = groups[name]
        # NCCL receives into the engine's GPU; gloo's wire is host memory, so its buckets are
        # staged there: a CUDA engine does not hold the model twice on the GPU during a push
        device = state.config.device if backends.get(name) == "nccl" else "cpu"
        try:
            async with session.receiving(name) as ticket:
                tensors = await trio.to_thread.run_sync(
                    lambda: _receive(group, names, dtypes, shapes, load_format, device)
                )
                session.stage(ticket, tensors, version, flush, abort_all)
        except Exception as exc:  # gloo/NCCL errors: a 400, as in SGLang
            logger.warning("receiving a broadcast on %s failed: %s", name, exc)
            return answer(False, f"Failed to receive weights: {exc}")
        logger.info("received %d tensor(s) of a broadcast on %s (staged until "
                    "end_weight_update)", len(tensors), name)  # fmt: skip
        return answer(True, "Succeeded to update parameter online.")


def _receive(group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]],
             load_format: str | None, device: str) -> dict[str, Any]:  # fmt: skip
    """The tensors rank 0 broadcasts on `group`, by name (blocks until received or failed)."""
    import torch

    from plumbing.process_group import unflatten_bucket

    types = [getattr(torch, d) for d in dtypes]
    if load_format == "flattened_bucket":
        size = sum(
            int(torch.Size(s).numel()) * t.itemsize for t, s in zip(types, shapes, strict=True)
        )
        flat = torch.empty(size, dtype=torch.uint8, device=device)
        torch.distributed.broadcast(flat, src=0, group=group)
        return dict(zip(names, unflatten_bucket(flat, types, shapes), strict=True))
    tensors = {n: torch.empty(s, dtype=t, device=device)
               for n, t, s in zip(names, types, shapes, strict=True)}  # fmt: skip
    handles = [torch.distributed.broadcast(t, src=0, group=group, async_op=True)
               for t in tensors.values()]  # fmt: skip
    for handle in handles:
        handle.wait()
    return tensors


def _field(body: dict[str, Any], name: str, kind: type, default: Any = ...) -> Any:
    """`body[name]` checked as pydantic would (a 400 naming the field), or `default`."""
    if name not in body or (body[name] is None and default is None):
        if default is ...:
            raise RequestValidationError(f"{name}: Field required")
        return default
    value = body[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestValidationError(f"{name}: Input should be a valid {kind.__name__}, got "
                                     f"{value!r}")  # fmt: skip
    return value


def _tensor_specs(body: dict[str, Any]) -> tuple[list[str], list[str], list[list[int]]]:
    names, dtypes, shapes = (_field(body, k, list) for k in ("names", "dtypes", "shapes"))
    if not len(names) == len(dtypes) == len(shapes):
        raise RequestValidationError(f"names, dtypes, shapes: lengths differ ({len(names)}, "
                                     f"{len(dtypes)}, {len(shapes)})")  # fmt: skip
    for i, (n, d, s) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(n, str) or d not in _DTYPES:
            raise RequestValidationError(f"names[{i}], dtypes[{i}]: a string and one of "
                                         f"{', '.join(_DTYPES)}; got {n!r}, {d!r}")  # fmt: skip
        if not isinstance(s, list) or not all(isinstance(x, int) and x >= 0 for x in s):
            raise RequestValidationError(f"shapes[{i}]: a list of sizes >= 0, got {s!r}")
    return names, dtypes, shapes
