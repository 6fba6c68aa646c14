"""LoRA adapters on SGLang servers (and the local engine), client side.

What SGLang 0.5.23 does, read from its source (`sglang` wheel from PyPI):
- `POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}` and
  `POST /unload_lora_adapter {"lora_name"}` (`srt/entrypoints/http_server.py`) answer
  `LoRAUpdateOutput` (`srt/managers/io_struct.py`): `{"success", "error_message",
  "loaded_adapters": {name: path}}`, HTTP 200 on success and 400 on failure, the failure still
  listing the adapters that stay loaded. Duplicate name → "Failed to load LoRA adapter <name>
  because it is already loaded" (`srt/lora/lora_manager.py::validate_new_adapter`); unloading
  an unknown name → "LoRA with name <name> does not exist. Loaded LoRAs: ..."
  (`srt/lora/lora_registry.py::unregister`); LoRA off → "LoRA is not enabled. Please set
  `--enable-lora` to enable LoRA." (`srt/managers/tokenizer_control_mixin.py`).
- `/generate` takes `lora_path`: an adapter NAME (despite the field's name), a string for the
  whole request or a list with one entry per prompt, None for the base model
  (`GenerateReqInput._normalize_lora_paths`). A name never loaded → 400
  `{"error": {"message": "Got LoRA adapter that has never been loaded: ..."}}`
  (`TokenizerManager._resolve_lora_path`); a name loaded once and unloaded since is loaded
  again implicitly from its old path.
- `/v1/completions` and `/v1/chat/completions` pick the adapter from `model="<base>:<adapter>"`
  or from a `lora_path` field (`OpenAIServingBase._resolve_lora_path`); a plain
  `model="<adapter>"` serves the BASE model. This client makes no `/v1` calls; a caller of
  those routes should send `model=f"{served_model_name}:{engine.active_lora}"`.
- Paths are resolved in the server's cwd, so this client sends absolute ones.

This module: `LoraClientMixin` (the two calls, mixed into `SGLangEngine`), the `ACTIVE` default
that makes generation use `engine.active_lora`, and `LoraLaunch` (the server flags).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plumbing.errors import EngineError


class _Active:
    def __repr__(self) -> str:
        return "ACTIVE"


ACTIVE: Any = _Active()  # `lora_path=` default: the engine's `active_lora` (None = base model)


def resolve_lora_path(engine: Any, lora_path: Any) -> Any:
    """The `lora_path` to send: the engine's `active_lora` unless the caller gave one (None
    included, which asks for the base model; a sequence gives one name per prompt)."""
    if lora_path is ACTIVE:
        return getattr(engine, "active_lora", None)
    return lora_path if lora_path is None or isinstance(lora_path, str) else list(lora_path)


def lost_adapter(engine: Any, exc: EngineError) -> bool:
    """A 400 naming an adapter as not loaded from an engine the last LoRA sync gave one: it
    restarted without it (`EnginePool` then treats it as stale and fails over)."""
    text = str(exc)
    return (
        getattr(engine, "expected_lora", None) is not None
        and exc.status == 400
        and "LoRA adapter" in text
        and ("never been loaded" in text or "not loaded" in text)
    )


class LoraAdapterError(EngineError):
    """The server refused a LoRA load/unload; `loaded_adapters` is what stays loaded."""

    loaded_adapters: dict[str, str]


def _loaded(result: Any) -> dict[str, str]:
    adapters = result.get("loaded_adapters") if isinstance(result, Mapping) else None
    return {str(k): str(v) for k, v in (adapters or {}).items()}


class LoraClientMixin:
    """`load_lora_adapter` / `unload_lora_adapter` for `SGLangEngine` (uses its `_http`)."""

    _http: Any
    timeouts: Any

    async def _lora_call(self, path: str, body: dict[str, Any], timeout: float | None
                         ) -> dict[str, str]:  # fmt: skip
        try:
            response = await self._http.request(
                "POST", path, body=body, timeout=timeout, admin=True
            )
        except EngineError as exc:
            if exc.status != 400:
                raise
            try:
                answer = json.loads(exc.body)
            except ValueError:
                raise exc from None
            error = LoraAdapterError(
                f"POST {path} failed: {answer.get('error_message') or answer}",
                url=self._http.url,
                status=400,
            )
            error.loaded_adapters = _loaded(answer)
            raise error from None
        answer = response.json()
        if not isinstance(answer, Mapping) or answer.get("success") is not True:
            raise EngineError(f"POST {path}: unexpected answer", url=self._http.url,
                              body=response.text)  # fmt: skip
        return _loaded(answer)

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str | os.PathLike[str], *, pinned: bool = False
    ) -> dict[str, str]:
        """`POST /load_lora_adapter` (path sent absolute, peft layout); returns the server's
        `loaded_adapters` ({name: path}).

        Raises:
            LoraAdapterError: refused (duplicate name, bad path, rank above `--max-lora-rank`,
                LoRA not enabled); the server's message and what stays loaded.
        """
        body = {"lora_name": lora_name, "lora_path": os.path.abspath(lora_path)}
        if pinned:
            body["pinned"] = True
        return await self._lora_call("/load_lora_adapter", body, self.timeouts.weight_update_s)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """`POST /unload_lora_adapter`; SGLang waits for the requests using it to finish.

        Raises:
            LoraAdapterError: unknown name (SGLang's "does not exist") or LoRA not enabled.
        """
        body = {"lora_name": lora_name}
        return await self._lora_call("/unload_lora_adapter", body, self.timeouts.control_s)


@dataclass(frozen=True)
class LoraLaunch:
    """Server flags for LoRA serving, the same for SGLang and the local engine.

    `target_modules`: "all" (SGLang's word; peft's "all-linear" is accepted and translated) or
    module names (`q_proj`, `v_proj`, ...). `max_lora_rank` must be at least every adapter's
    rank, else SGLang refuses the load. `max_loras_per_batch` counts the base model too
    (SGLang's default 8); keep it above the number of adapters kept loaded.
    """

    max_lora_rank: int
    target_modules: str | Sequence[str] = "all"
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise ValueError(f"LoraLaunch.max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loras_per_batch < 1:
            raise ValueError(
                f"LoraLaunch.max_loras_per_batch must be >= 1, got {self.max_loras_per_batch}"
            )

    def args(self) -> list[str]:
        modules = self.target_modules
        if isinstance(modules, str):
            modules = ["all" if modules in ("all", "all-linear") else modules]
        args = ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
                "--lora-target-modules", *modules,
                "--max-loras-per-batch", str(self.max_loras_per_batch)]  # fmt: skip
        if self.max_loaded_loras is not None:
            args += ["--max-loaded-loras", str(self.max_loaded_loras)]
        return args
