"""The local engine's LoRA adapter registry: SGLang 0.5.23's rules, on the trio side (no torch).

What it follows (SGLang 0.5.23, `sglang` wheel from PyPI):
- `/load_lora_adapter` and `/unload_lora_adapter` answer `{"success", "error_message",
  "loaded_adapters"}` (`LoRAUpdateOutput`, `srt/managers/io_struct.py`), 200 or 400
  (`srt/entrypoints/http_server.py`). `error_message` is "" on success.
- Refusals that happen in SGLang's tokenizer manager (`tokenizer_control_mixin.py`:
  LoRA not enabled; `lora_registry.py::unregister`: unloading a name that is not loaded,
  "LoRA with name X does not exist. Loaded LoRAs: odict_keys([...])") carry
  `loaded_adapters: null`; those of the model side (`lora_manager.py::validate_new_adapter` and
  the load itself: duplicate name "Failed to load LoRA adapter X because it is already loaded",
  rank above `--max-lora-rank`, target modules outside `--lora-target-modules`, an unreadable
  path) list the adapters that stay loaded. A failed load changes nothing.
- A request naming an adapter (`TokenizerManager._validate_and_resolve_lora`): with LoRA off,
  "LoRA adapter 'X' was requested, but LoRA is not enabled. ..."; a name never loaded, "Got LoRA
  adapter that has never been loaded: X\\nAll loaded adapters: dict_keys([...])."; a name loaded
  once and unloaded since (or evicted by `--max-loaded-loras`) is loaded again from its path.
  More distinct names (None counted) than `--max-loaded-loras` in one request is refused.
- Unloading waits until no request uses the adapter (`LoRARegistry.wait_for_unload`); the name
  is unregistered first, so new requests cannot start on it.
- `--max-loaded-loras`: past it, the least recently used unpinned adapter is unloaded after a
  load. Pinned adapters may not take every `--max-loras-per-batch` slot but one.
- Adapter paths are used as given: a relative one is resolved in the server's cwd (as SGLang).
- Names in a request are resolved once a pause is over (`Scheduler.submit`), as SGLang's
  tokenizer manager waits for the pause before `_validate_and_resolve_lora`.

Departures from SGLang: a path that is not a directory is not tried as a Hugging Face repo id
(the error is the missing `<path>/adapter_config.json`); a duplicate name is refused before
the adapter is read (SGLang reads its config first, so a duplicate name with a bad path reports
the path there); a `lora_path` list whose length is not the batch size is a 400 (SGLang does
not check it); `/load_lora_adapter_from_tensors` does not exist (it unpickles its payload).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import trio

from .sampling_params import BadRequestError

logger = logging.getLogger(__name__)

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoraLoadError(Exception):
    """The model side refused an adapter; the message is SGLang's wording."""


@dataclass(frozen=True)
class LoraRef:
    lora_name: str
    lora_path: str
    pinned: bool = False


def parse_lora_paths(values: tuple[str, ...] | list[str]) -> list[LoraRef]:
    """`--lora-paths` items: `PATH`, `NAME=PATH`, or JSON `{"lora_name", "lora_path", "pinned"}`
    (SGLang's `LoRAPathAction` and `check_lora_server_args`)."""
    refs = []
    for raw in values:
        value = raw.strip()
        if value.startswith("{") and value.endswith("}"):
            obj = json.loads(value)
            if "lora_name" not in obj or "lora_path" not in obj:
                raise ValueError(
                    f"{value!r} looks like a JSON str, but it does not contain 'lora_name' and "
                    "'lora_path' keys."
                )
            refs.append(LoraRef(obj["lora_name"], obj["lora_path"], bool(obj.get("pinned"))))
        elif "=" in value:
            name, path = value.split("=", 1)
            refs.append(LoraRef(name, path))
        else:
            refs.append(LoraRef(value, value))
    return refs


def _result(success: bool, error: str = "", loaded: dict[str, str] | None = None) -> dict:
    return {"success": success, "error_message": error, "loaded_adapters": loaded}


class LoraRegistry:
    """Names → paths of the loaded adapters, in least-recently-used order, plus every name
    ever loaded (for implicit reloads). `runner` runs `load_lora(name, path)` and
    `delete_lora(name)`; `scheduler` runs them on the model thread and counts the requests
    using each adapter."""

    def __init__(
        self,
        scheduler: Any,
        runner: Any,
        *,
        enabled: bool,
        max_loaded_loras: int | None = None,
        max_loras_per_batch: int = 8,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.enabled = enabled
        self.max_loaded_loras = max_loaded_loras
        self.max_loras_per_batch = max_loras_per_batch
        self._loaded: OrderedDict[str, LoraRef] = OrderedDict()
        self._ever: dict[str, LoraRef] = {}  # SGLang's `lora_ref_cache`
        self._lock = trio.Lock()

    def register_preloaded(self, ref: LoraRef) -> None:
        """An adapter the runner loaded at start-up (`--lora-paths`)."""
        self._loaded[ref.lora_name] = self._ever[ref.lora_name] = ref

    def loaded_adapters(self) -> dict[str, str]:
        return {name: ref.lora_path for name, ref in self._loaded.items()}

    def refs(self) -> list[LoraRef]:
        return list(self._loaded.values())

    # ----- load / unload ----------------------------------------------------------------------

    async def load(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        if not self.enabled:
            return _result(False, NOT_ENABLED)
        async with self._lock:
            return await self._load(LoraRef(name, path, pinned))

    async def _load(self, ref: LoraRef) -> dict[str, Any]:
        name = ref.lora_name
        if name in self._loaded:
            message = f"Failed to load LoRA adapter {name} because it is already loaded"
            return _result(False, message, self.loaded_adapters())
        pinned = sum(r.pinned for r in self._loaded.values())
        if ref.pinned and pinned >= self.max_loras_per_batch - 1:
            message = (
                f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to "
                "pin all slots in the LoRA memory pool to avoid starvation for unpinned adapters "
                "and base models. Please increase your `--max-loras-per-batch` or load it as "
                "unpinned LoRA adapters."
            )
            return _result(False, message, self.loaded_adapters())
        try:
            await self.scheduler.run_on_model_thread(self.runner.load_lora, name, ref.lora_path)
        except LoraLoadError as exc:
            logger.warning("LoRA adapter %s from %s refused: %s", name, ref.lora_path, exc)
            return _result(False, str(exc), self.loaded_adapters())
        self._loaded[name] = self._ever[name] = ref
        logger.info("loaded LoRA adapter %s from %s", name, ref.lora_path)
        while self.max_loaded_loras is not None and len(self._loaded) > self.max_loaded_loras:
            victim = next((n for n, r in self._loaded.items() if not r.pinned), None)
            if victim is None:
                break
            logger.info("unloading least recently used LoRA adapter %s", victim)
            await self._unload(victim)
        return _result(True, "", self.loaded_adapters())

    async def unload(self, name: str) -> dict[str, Any]:
        if not self.enabled:
            return _result(False, NOT_ENABLED)
        async with self._lock:
            if name not in self._loaded:
                message = (
                    f"LoRA with name {name} does not exist. Loaded LoRAs: {self._loaded.keys()}"
                )
                return _result(False, message)
            await self._unload(name)
            return _result(True, "", self.loaded_adapters())

    async def _unload(self, name: str) -> None:
        del self._loaded[name]  # new requests can no longer start on it
        await self.scheduler.wait_lora_unused(name)
        await self.scheduler.run_on_model_thread(self.runner.delete_lora, name)
        logger.info("unloaded LoRA adapter %s", name)

    # ----- requests ---------------------------------------------------------------------------

    async def resolve(self, names: list[str | None]) -> None:
        """Check the adapters a request names, loading evicted ones again.

        Raises:
            BadRequestError: SGLang's message (LoRA off, never loaded, too many, reload failed).
        """
        wanted = [n for n in names if n]
        if not wanted:
            return
        if not self.enabled:
            raise BadRequestError(
                f"LoRA adapter '{wanted[0]}' was requested, but LoRA is not enabled. Please "
                "launch the server with --enable-lora flag and preload adapters using "
                "--lora-paths or /load_lora_adapter endpoint."
            )
        unique = list(dict.fromkeys(names))
        if self.max_loaded_loras is not None and len(unique) > self.max_loaded_loras:
            raise BadRequestError(
                f"Received request with {len(unique)} unique loras requested but max loaded "
                f"loras is {self.max_loaded_loras}"
            )
        for name in unique:
            if name is None:
                continue
            if name in self._loaded:
                self._loaded.move_to_end(name)  # a lookup counts as a use (LRU)
                continue
            if name not in self._ever:
                raise BadRequestError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {self._ever.keys()}."
                )
            logger.info("Reloading evicted adapter: %s", name)
            ref = self._ever[name]
            result = await self.load(ref.lora_name, ref.lora_path, ref.pinned)
            if not result["success"] and "already loaded" not in result["error_message"]:
                raise BadRequestError(
                    f"Failed to implicitly load LoRA adapter {name}: {result['error_message']}"
                )

    def check_loaded(self, names: list[str | None]) -> None:
        """At submission: every named adapter is still loaded (SGLang's `LoRARegistry.acquire`)."""
        for name in names:
            if name is not None and name not in self._loaded:
                raise BadRequestError(
                    f"The following requested LoRA adapters are not loaded: {name}\n"
                    f"Loaded adapters: {self._loaded.keys()}."
                )
