"""One Tinker training model: a `PyTorchTrainingBackend` (LoRA or full) driven the way the
`tinker` SDK asks — per-datum Tinker losses, per-call Adam hyper-parameters, named state
checkpoints, and weight pushes to the sampling engine.

Every operation runs on the backend's ordered worker thread (`backend.call` /
`save_checkpoint` / `export_weights`), so torch never blocks the server's event loop and the
order the requests were sequenced in is the order they run in. The server validates inputs
before queueing anything (rollouts/tinker_server/losses.py `check_request`): a backend
operation that fails fails every later one (training/backend/pytorch.py), which is right for a
crash but would be wrong for a caller's typo.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollouts.tinker_server.losses import LOSSES, loss_inputs
from rollouts.tinker_server.wire import Datum, TinkerRequestError
from training.backend.model_io import dropout_off
from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
from training.config import LoraSettings, OptimConfig
from training.loops.weight_push import push_weights

META = "tinker_model.json"


@dataclass
class ModelSpec:
    """What a training model is made of, written beside its checkpoints (`META`) so that a
    restarted server can rebuild it from a `tinker://` path."""

    model_id: str
    base_model: str
    lora_rank: int | None
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


@dataclass
class TinkerModel:
    spec: ModelSpec
    backend: PyTorchTrainingBackend
    run_dir: Path
    micro_batch_tokens: int = 8192
    adapter_name: str | None = None
    sampler_saves: int = 0
    states: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, spec: ModelSpec, model_path: str, run_dir: Path, *, adapter_name: str,
              lora_keep: int = 4, device: str = "cpu", dtype: str = "float32") -> TinkerModel:  # fmt: skip
        lora = None
        if spec.lora_rank is not None:
            lora = LoraSettings(rank=spec.lora_rank, name=adapter_name, keep=lora_keep)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / META).write_text(spec.to_json(), encoding="utf-8")
        backend = PyTorchTrainingBackend(
            partial(load_model, model_path, device=device, dtype=dtype), load_tokenizer(model_path),
            optim=OptimConfig(lr=1e-4, schedule="constant", weight_decay=0.0, grad_clip=None),
            max_steps=1, checkpoint_dir=run_dir / "weights", pack_length=None, keep_last=None,
            seed=spec.seed, lora=lora,
        )  # fmt: skip
        return cls(spec, backend, run_dir, adapter_name=adapter_name if lora else None)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.model.get_input_embeddings().weight.shape[0])

    @property
    def max_length(self) -> int:
        config = getattr(self.backend.model, "config", None)
        return int(getattr(config, "max_position_embeddings", None) or 1 << 30)

    # -- forward / backward --------------------------------------------------------------------

    async def forward_backward(self, data: list[Datum], loss_fn: str, config: dict,
                               forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict]:  # fmt: skip
        run = partial(self._forward_backward, data, loss_fn, config, forward_only)
        return await self.backend.call(run).result()

    def _micro_batches(self, data: list[Datum]) -> list[list[Datum]]:
        batches: list[list[Datum]] = [[]]
        width = 0
        for datum in data:
            n = len(datum.tokens)
            if batches[-1] and max(width, n) * (len(batches[-1]) + 1) > self.micro_batch_tokens:
                batches.append([])
                width = 0
            batches[-1].append(datum)
            width = max(width, n)
        return batches

    def _forward_backward(self, data: list[Datum], loss_fn: str, config: dict,
                          forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict]:  # fmt: skip
        """Trainer thread: target logprobs of every datum (dropout off, as the sampler's),
        the loss's per-token values, their sum backpropagated (gradients accumulate until
        `optim_step`)."""
        model, device = self.backend.model, self.backend.device
        fn, _ = LOSSES[loss_fn]
        pad = self.backend.pad_id or 0
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        with torch.set_grad_enabled(not forward_only), dropout_off(model):
            for batch in self._micro_batches(data):
                width = max(len(d.tokens) for d in batch)
                ids = torch.full((len(batch), width), pad, dtype=torch.long)
                targets = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for i, d in enumerate(batch):
                    n = len(d.tokens)
                    ids[i, :n] = torch.tensor(d.tokens)
                    targets[i, :n] = torch.as_tensor(d.inputs["target_tokens"].astype(np.int64))
                    mask[i, :n] = 1
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                logp = torch.log_softmax(logits.float(), dim=-1)
                lp_BT = logp.gather(-1, targets.to(device)[..., None]).squeeze(-1)
                sums = []
                for i, d in enumerate(batch):
                    lp = lp_BT[i, : len(d.tokens)]
                    elementwise = fn(lp, loss_inputs(d, device), config)
                    sums.append(elementwise.sum())
                    outputs.append({"logprobs": lp.detach().cpu().numpy(),
                                    "elementwise_loss": elementwise.detach().cpu().numpy()})  # fmt: skip
                loss = torch.stack(sums).sum()
                if not forward_only:
                    loss.backward()
                total += float(loss.detach())
        return outputs, {"loss:sum": total}

    # -- optimizer -----------------------------------------------------------------------------

    async def optim_step(self, adam: dict[str, Any]) -> dict[str, float]:
        return await self.backend.call(partial(self._optim_step, adam)).result()

    def _optim_step(self, adam: dict[str, Any]) -> dict[str, float]:
        """Trainer thread: AdamW with this call's hyper-parameters (Tinker sends them with
        every step; the schedule lives in the client), clipping when grad_clip_norm > 0."""
        optimizer = self.backend.optimizer
        lr = float(adam.get("learning_rate", 1e-4))
        for group in optimizer.param_groups:
            group["lr"] = lr
            group["betas"] = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
            group["eps"] = float(adam.get("eps", 1e-12))
            group["weight_decay"] = float(adam.get("weight_decay", 0.0))
        clip = float(adam.get("grad_clip_norm", 0.0) or 0.0)
        params = [p for p in self.backend.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.backend.step += 1
        self.backend.weight_version += 1
        return {"grad_norm": float(norm), "learning_rate": lr, "step": float(self.backend.step)}

    # -- state ---------------------------------------------------------------------------------

    def state_dir(self, name: str) -> Path:
        return self.run_dir / "weights" / name

    async def save_state(self, name: str) -> None:
        self.backend.checkpoint_dir = self.state_dir(name)  # read by the queued save
        await self.backend.save_checkpoint(self.backend.step, {}, extra_state={"name": name})
        self.states.append(name)

    async def load_state(self, directory: Path, *, optimizer: bool) -> None:
        await self.backend.load_checkpoint(directory)
        if not optimizer:  # weights only: a fresh Adam (no moments), as Tinker's load_state
            await self.backend.call(lambda: self.backend.optimizer.state.clear()).result()

    # -- sampling ------------------------------------------------------------------------------

    async def push(self, engine: Any) -> tuple[str | None, int]:
        """Export the current weights and load them into `engine`; (the adapter name the
        engine serves them under, None for full weights; the weight version)."""
        version = self.backend.weight_version
        # Samples in flight (an older sampling client's) must survive the push's pause: with
        # LoRA they keep their own adapter ("in_place"); with full weights they are recomputed
        # on the new ones ("retract"). The default "abort" would fail them.
        mode = "in_place" if self.backend.lora else "retract"
        await push_weights(self.backend, [engine], self.run_dir / "sampler_weights",
                           pause_mode=mode,
                           keep=self.backend.lora.keep if self.backend.lora else 2)  # fmt: skip
        name = None if self.adapter_name is None else f"{self.adapter_name}-v{version}"
        self.sampler_saves += 1
        return name, version


def read_spec(run_dir: Path) -> ModelSpec:
    path = run_dir / META
    if not path.is_file():
        raise TinkerRequestError(f"no model saved at {run_dir} ({META} is missing)", status=404)
    return ModelSpec(**json.loads(path.read_text(encoding="utf-8")))
