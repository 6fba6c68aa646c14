"""The server's state: sessions, training models (each with its ordered queue), sampling
sessions, `tinker://` paths, and the sampling engine behind `asample`.

Paths: `tinker://<model_id>/weights/<name>` is a `save_state` checkpoint, kept in
`<run_root>/<model_id>/weights/<name>/` (a restarted server with the same run root loads it);
`tinker://<model_id>/sampler_weights/<name>` names weights pushed to the engine for sampling.

Sampling clients of older versions: with LoRA each push is its own adapter on the engine
(`<adapter>-v<version>`), so a sampling client keeps sampling the weights it was made from
while the engine holds that adapter (the newest `lora_keep` versions); with full weights the
engine holds one set, so every sampling client samples the newest weights pushed.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from rollouts.tinker_server.futures import FutureTable, ModelQueue
from rollouts.tinker_server.trainer import ModelSpec, TinkerModel, read_spec
from rollouts.tinker_server.wire import TinkerRequestError

_SAFE = re.compile(r"^[A-Za-z0-9_.:-]+$")


@dataclass
class Sampler:
    """What a sampling session samples: the adapter on the engine (None: the engine's full
    weights, or the base model when `model_id` is None) and the weight version."""

    model_id: str | None
    adapter: str | None
    version: int
    model_path: str | None = None


class TinkerService:
    def __init__(self, model_path: str, run_root: Path, engine: Any, nursery: trio.Nursery, *,
                 model_names: tuple[str, ...] = (), max_lora_rank: int = 32,
                 lora_keep: int = 4, table: FutureTable | None = None,
                 device: str = "cpu", dtype: str = "float32",
                 client_config: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.model_path, self.run_root, self.engine = model_path, Path(run_root), engine
        self.nursery = nursery
        path = Path(model_path)
        self.base_name = model_names[0] if model_names else model_path
        # what the SDK's get_tokenizer() loads: the directory, wherever the client runs
        self.tokenizer_id = str(path.resolve()) if path.is_dir() else model_path
        self.names = {model_path, str(path.resolve()), path.name, *model_names}
        self.max_lora_rank, self.lora_keep = max_lora_rank, lora_keep
        self.device, self.dtype = device, dtype  # of the trainers
        self.client_config = dict(client_config or {})  # over routes.CLIENT_CONFIG
        self.table = table or FutureTable()
        self.sessions: set[str] = set()
        self.models: dict[str, TinkerModel] = {}
        self._building: set[str] = set()  # model ids whose create_model is under way
        self.queues: dict[str, ModelQueue] = {}
        self.samplers: dict[str, Sampler] = {}
        self.sampler_paths: dict[str, Sampler] = {}
        self._adapters = 0
        self.request_counts: Counter[str] = Counter()  # HTTP requests by route

    # -- names and paths -------------------------------------------------------------------------

    def check_base_model(self, name: str | None) -> None:
        if name is None or name in self.names:
            return
        raise TinkerRequestError(
            f"base_model {name!r} is not served here: this server trains {self.base_name!r} "
            f"(it also answers to {sorted(self.names - {self.base_name})}); pass one of those as "
            "base_model, or start `rollouts tinker-serve --model` with the model you want"
        )

    def model(self, model_id: str) -> TinkerModel:
        found = self.models.get(model_id)
        if found is None:
            raise TinkerRequestError(
                f"unknown model_id {model_id!r}: this server holds {sorted(self.models) or 'none'}"
                " (models do not survive a restart: load_state from a tinker:// path instead)",
                status=404,
            )
        return found

    def state_path(self, model_id: str, name: str) -> str:
        return f"tinker://{model_id}/weights/{name}"

    def resolve_state(self, tinker_path: str) -> tuple[Path, ModelSpec]:
        """A `tinker://<model>/weights/<name>` path -> (its checkpoint directory, the model it
        was saved from)."""
        parts = tinker_path.removeprefix("tinker://").split("/")
        if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights" \
                or not all(_SAFE.match(p) for p in parts):  # fmt: skip
            raise TinkerRequestError(
                f"{tinker_path!r} is not a state path of this server: expected "
                "tinker://<model_id>/weights/<name> as save_state returned it"
            )
        run_dir = self.run_root / parts[0]
        directory = run_dir / "weights" / parts[2]
        if not directory.is_dir():
            raise TinkerRequestError(f"no checkpoint {tinker_path!r} (looked in {directory})",
                                     status=404)  # fmt: skip
        return directory, read_spec(run_dir)

    @staticmethod
    def check_name(name: str, what: str) -> str:
        if not _SAFE.match(name) or ":" in name:
            raise TinkerRequestError(f"{what} {name!r}: use letters, digits, '_', '.', '-'")
        return name

    # -- models ------------------------------------------------------------------------------------

    async def create_model(self, model_id: str, base_model: str, lora_rank: int | None,
                           seed: int | None, next_seq: int = 1) -> TinkerModel:  # fmt: skip
        self.check_base_model(base_model)
        if lora_rank is not None and not 1 <= lora_rank <= self.max_lora_rank:
            raise TinkerRequestError(
                f"LoRA rank {lora_rank}: this server takes 1..{self.max_lora_rank} "
                "(`rollouts tinker-serve --max-lora-rank` raises the bound)"
            )
        # taken from the start of its build: a create_model sent again (the SDK resends one
        # whose answer was lost) would build a second model and replace the first
        if model_id in self.models or model_id in self._building:
            raise TinkerRequestError(f"model_id {model_id!r} exists already")
        spec = ModelSpec(model_id, self.base_name, lora_rank, seed or 0)
        self._adapters += 1
        adapter = f"tinker{self._adapters}-{uuid.uuid4().hex[:6]}"
        self._building.add(model_id)
        try:
            model = await trio.to_thread.run_sync(lambda: TinkerModel.build(
                spec, self.model_path, self.run_root / model_id, adapter_name=adapter,
                lora_keep=self.lora_keep, device=self.device, dtype=self.dtype))  # fmt: skip
        finally:
            self._building.discard(model_id)
        self.models[model_id] = model
        self.queues[model_id] = ModelQueue(self.nursery, self.table, f"model {model_id}",
                                           next_seq=next_seq)  # fmt: skip
        return model

    def submit(self, model_id: str, seq_id: int | None, job) -> dict[str, Any]:
        """Queue `job` on the model's ordered queue; the SDK's `UntypedAPIFuture`."""
        self.model(model_id)
        queue = self.queues[model_id]
        seq = queue.next_seq if seq_id is None else seq_id
        return {"request_id": queue.submit(seq, job), "model_id": model_id}

    def start(self, job, **extra: Any) -> dict[str, Any]:
        """Run `job` now, outside any model's order (model creation, sampling)."""
        request_id, entry = self.table.new()
        self.nursery.start_soon(FutureTable.run, entry, job)
        return {"request_id": request_id, **extra}

    # -- sampling ----------------------------------------------------------------------------------

    async def save_for_sampler(self, model_id: str, session_id: str | None,
                               sampling_seq: int | None, name: str | None) -> dict[str, Any]:  # fmt: skip
        model = self.model(model_id)
        adapter, version = await model.push(self.engine)
        path = f"tinker://{model_id}/sampler_weights/{name or f'v{version}-{model.sampler_saves}'}"
        sampler = Sampler(model_id, adapter, version, path)
        self.sampler_paths[path] = sampler
        out: dict[str, Any] = {"path": path, "type": "save_weights_for_sampler"}
        if sampling_seq is not None:
            sampler_id = f"{session_id or model_id}:sample:{sampling_seq}"
            self.samplers[sampler_id] = sampler
            out["sampling_session_id"] = sampler_id
        return out

    def create_sampling_session(self, session_id: str, seq: int, base_model: str | None,
                                model_path: str | None) -> str:  # fmt: skip
        if model_path is not None:
            sampler = self.sampler_paths.get(model_path)
            if sampler is None:
                raise TinkerRequestError(
                    f"model_path {model_path!r}: no sampler weights by that path on this server "
                    f"(it has {sorted(self.sampler_paths) or 'none'}); save_weights_for_sampler "
                    "first", status=404)  # fmt: skip
        else:
            self.check_base_model(base_model)
            sampler = Sampler(None, None, 0)
        sampler_id = f"{session_id}:sample:{seq}"
        self.samplers[sampler_id] = sampler
        return sampler_id

    def sampler(self, sampler_id: str | None) -> Sampler:
        found = self.samplers.get(sampler_id or "")
        if found is None:
            raise TinkerRequestError(f"unknown sampling_session_id {sampler_id!r}", status=404)
        return found
