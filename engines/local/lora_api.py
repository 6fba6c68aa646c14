"""LoRA routes of the local engine: `/load_lora_adapter`, `/unload_lora_adapter` (SGLang 0.5.23).

Bodies: `{"lora_name", "lora_path", "pinned"}` and `{"lora_name"}`; answers
`{"success", "error_message", "loaded_adapters"}` with 200 on success and 400 on a refusal (see
lora_registry.py for which refusal says what). A body without the required string fields is
a validation error: 400 `{"object": "error", ...}`. Also here: how the OpenAI routes pick an
adapter from `model` (`OpenAIServingBase._parse_model_parameter` / `_resolve_lora_path`).
"""

from __future__ import annotations

from typing import Any

from .asgi import App, Request, Response, json_response, object_error
from .route_helpers import not_ready, read_json
from .sampling_params import RequestValidationError
from .state import EngineState


def _fields(request: Request, names: tuple[str, ...]) -> dict[str, Any]:
    body = read_json(request)
    if not isinstance(body, dict):
        raise RequestValidationError("Input should be a valid dictionary")
    for name in names:
        if not isinstance(body.get(name), str) or not body[name]:
            raise RequestValidationError(f"{name}: Field required (a non-empty string)")
    if not isinstance(body.get("pinned", False), bool):
        raise RequestValidationError("pinned: Input should be a valid boolean")
    return body


def register_lora_routes(app: App, state: EngineState) -> None:
    @app.route("/load_lora_adapter", methods=("POST",), admin=True)
    async def load_lora_adapter(request: Request) -> Response:
        try:
            body = _fields(request, ("lora_name", "lora_path"))
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        if state.lora is None:
            return not_ready()
        result = await state.lora.load(
            body["lora_name"], body["lora_path"], bool(body.get("pinned"))
        )
        return json_response(result, 200 if result["success"] else 400)

    @app.route("/unload_lora_adapter", methods=("POST",), admin=True)
    async def unload_lora_adapter(request: Request) -> Response:
        try:
            body = _fields(request, ("lora_name",))
        except RequestValidationError as exc:
            return object_error(str(exc), 400, "Bad Request")
        if state.lora is None:
            return not_ready()
        result = await state.lora.unload(body["lora_name"])
        return json_response(result, 200 if result["success"] else 400)


def adapter_from_model(model: Any, served_model_name: str) -> str | None:
    """SGLang's `_parse_model_parameter`: "base:adapter" names an adapter; the served name
    itself (even with colons) or a name without a colon names the base model."""
    if not isinstance(model, str) or ":" not in model or model == served_model_name:
        return None
    if model.startswith(f"{served_model_name}:"):
        adapter = model[len(served_model_name) + 1 :]
    else:
        adapter = model.split(":", 1)[1]
    return adapter.strip() or None


def openai_lora_path(body: dict[str, Any], served_model_name: str) -> Any:
    """The `lora_path` of an OpenAI request: the adapter in `model` first, else the request's
    own `lora_path` field (SGLang's `_resolve_lora_path`)."""
    return adapter_from_model(body.get("model"), served_model_name) or body.get("lora_path")


def adapter_cards(state: EngineState, base: dict[str, Any]) -> list[dict[str, Any]]:
    """`/v1/models` entries for the loaded adapters: SGLang 0.5.23 lists each with its path as
    `root` and the served model as `parent` (`http_server.py::available_models`)."""
    if state.lora is None or not state.lora.enabled:
        return []
    return [
        {**base, "id": name, "root": path, "parent": base["id"], "max_model_len": None}
        for name, path in state.lora.loaded_adapters().items()
    ]
