"""The backend's state operations: weights across backends, checkpoints, exports, resume.

A mixin of `PyTorchTrainingBackend` (training/backend/pytorch.py), split off to keep each file
readable; every method goes through the backend's `_submit` / `_dispatch`, so it runs in queue
order on every rank like the training operations.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from training.backend import checkpoint as ckpt
from training.backend import lora as lo
from training.backend import state as st
from training.backend.futures import BackendError, TrainFuture
from training.backend.weight_buckets import Bucket, gathered_buckets

if TYPE_CHECKING:
    from training.backend.pytorch import PyTorchTrainingBackend


class StateOps:
    # -- weights across backends (collective: safe inside `call`) ------------------------------

    def copy_weights_from(self, other: PyTorchTrainingBackend) -> None:
        """self ← other, every weight (run on the trainer thread, e.g. inside `call`)."""
        self._dispatch("lerp_weights", None, {"other": other, "weight": 1.0})

    def lerp_weights_from(self, other: PyTorchTrainingBackend, weight: float) -> None:
        """self ← self + weight · (other − self) (an EMA step with weight = 1 − alpha)."""
        self._dispatch("lerp_weights", None, {"other": other, "weight": weight})

    def _local_lerp_weights(self, other: PyTorchTrainingBackend, weight: float) -> None:
        st.lerp_params(self.model, other.model, weight)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict, on rank 0 (trainer thread, e.g. inside `call`)."""
        return self._dispatch("full_state", None, {})[0][0]

    def _local_full_state(self) -> dict[str, torch.Tensor]:
        return st.full_model_state(self.model)

    def load_weights_from_checkpoint(self, path: str | Path, key: str) -> None:
        """Weights ← `extra_tensors[key]["weights"]` of the checkpoint at `path` (every rank
        reads the file; trainer thread, e.g. inside `call`)."""
        self._dispatch("load_extra_weights", None, {"path": Path(path), "key": key})

    def _local_load_extra_weights(self, path: Path, key: str) -> None:
        weights = self.read_extra_tensors(path)[key]["weights"]
        st.load_full_model_state(self.model, weights)

    def full_grads(self) -> TrainFuture[dict[str, torch.Tensor]]:
        """Queue a read of the accumulated gradients, whole (gathered to rank 0 under torchrun):
        what a test compares across world sizes."""
        return self._submit(lambda: self._dispatch("full_grads", None, {})[0][0])

    def _local_full_grads(self) -> dict[str, torch.Tensor]:
        grads = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                full = getattr(p.grad, "full_tensor", None)  # a collective: every rank calls it
                grads[name] = (full() if full is not None else p.grad).detach().clone().cpu()
        return grads

    # -- checkpoints ----------------------------------------------------------------------------

    async def save_checkpoint(
        self,
        step: int,
        metrics: dict[str, Any],
        *,
        extra_state: dict[str, Any] | None = None,
        extra_tensors: dict[str, Any] | None = None,
    ) -> Path:
        """Write a checkpoint after all queued work; returns its directory.

        `extra_state` (JSON) and `extra_tensors` (tensors and plain values, e.g. a reference
        model's weights) are written into the same atomic checkpoint; `read_extra_tensors`
        gives the latter back. The model's weights are stored once, in the HF layout (written
        by rank 0 under torchrun); every rank writes its shards of the optimizer state (DCP;
        with LoRA the adapter's too), rank 0 the rest, and `latest` moves when all did.
        """
        return await self._submit(
            lambda: self._save(step, metrics, extra_state or {}, extra_tensors or {})
        ).result()

    def _save(self, step: int, metrics: dict[str, Any], extra: dict[str, Any],
              extra_tensors: dict[str, Any]) -> Path:  # fmt: skip
        if self.optimizer is None or self.scheduler is None:
            raise BackendError("a frozen backend (no optimizer) is not checkpointed")
        torch_state = {
            "scheduler": self.scheduler.state_dict(),
            "rng": ckpt.rng_state(),
            "extra": extra_tensors,
        }
        json_state = {
            "step": self.step,
            "weight_version": self.weight_version,
            "metrics": metrics,
            "extra": extra,
            "world_size": self._dist.world if self._dist else 1,
        }
        needed = 3 * st.model_bytes(self.model, trainable_only=self.lora is not None)
        needed *= self._dist.world if self._dist else 1
        if self.lora is not None and self.lora.merged_export:
            needed += st.model_bytes(self.model) * (self._dist.world if self._dist else 1)
        needed += ckpt.tensor_bytes(torch_state)
        tmp, final = ckpt.begin_checkpoint(self.checkpoint_dir, step, needed)
        try:
            self._dispatch("write_shards", None, {"tmp": tmp})
            ckpt.write_trainer_state(tmp, torch_state, json_state)
        except BaseException as err:
            ckpt.abandon(tmp, final, err, needed)
            raise
        return ckpt.finish_checkpoint(self.checkpoint_dir, tmp, final, self.keep_last)

    def _local_write_shards(self, tmp: Path) -> None:
        # A full model's weights are in the HF export only; an adapter is also in DCP (it is
        # small, and peft's file renames its weights). The frozen base of a LoRA model is the
        # model it was built from.
        adapter_only = self.lora is not None
        st.save_sharded(self.model, self.optimizer, tmp / ckpt.DCP_DIR, self._dist,
                        with_model=adapter_only, trainable_only=adapter_only)  # fmt: skip
        self._local_export(tmp, checkpoint=True)
        st.barrier(self._dist)

    @staticmethod
    def read_extra_tensors(path: str | Path) -> dict[str, Any]:
        """The `extra_tensors` saved with the checkpoint at `path` ({} if none were)."""
        _, torch_state = ckpt.read_checkpoint_state(ckpt.resolve_checkpoint(path))
        return dict(torch_state.get("extra", {}))

    async def export_weights(self, out_dir: str | Path) -> Path:
        """Write the current weights in HF layout (what engines load) after queued work; with
        LoRA only the adapter, in peft's layout (what `/load_lora_adapter` loads).

        Under torchrun the full weights are gathered to rank 0 (its CPU memory holds one full
        copy while it writes), which writes them.
        """
        out = Path(out_dir)
        return await self._submit(
            lambda: self._dispatch("export", None, {"out": out})[0][0]
        ).result()

    def broadcast_weights(self, send: Callable[[list[torch.Tensor]], None], plan: list[Bucket],
                          out: Path, *, export: bool, confirm: Callable[[], bool] = lambda: True,
                          device: str = "cpu") -> TrainFuture[
                              tuple[BaseException | None, Path | None]]:  # fmt: skip
        """Queue a push of the weights by broadcast: each bucket of `plan` gathered whole (FSDP2:
        bucket by bucket, training/backend/weight_buckets.py) and handed to `send` on rank 0.

        After the first failed `send` the remaining buckets are still gathered (the other
        ranks take part in every gather) but not sent. After the last, rank 0 asks `confirm()`
        (did every engine take them?). Then the HF export to `out` runs when `export` (an
        engine is out of the group and loads from disk), a send failed or `confirm` said no:
        still in queue order, so the export holds the weights that were broadcast.

        Returns (a future of):
            (the send's failure or None, `out` if exported else None).
        """
        if self.lora is not None:
            raise ValueError("broadcast_weights: LoRA adapters go through disk (export_weights)")

        def run() -> tuple[BaseException | None, Path | None]:
            # rank 0's only: functions cannot travel to the other ranks
            self._refit_send = (send, confirm)
            try:
                args = {"plan": plan, "out": out, "export": export, "device": device}
                return self._dispatch("broadcast_weights", None, args)[0][0]
            finally:
                self._refit_send = None

        return self._submit(run)

    def _local_broadcast_weights(self, plan: list[Bucket], out: Path, export: bool,
                                 device: str) -> tuple[BaseException | None, Path | None]:  # fmt: skip
        rank0 = self._dist is None or self._dist.rank == 0
        send, confirm = (
            getattr(self, "_refit_send", None) or (None, None) if rank0 else (None, None)
        )
        failed: BaseException | None = None
        for tensors in gathered_buckets(self.model, plan, device):
            if send is not None and failed is None:
                try:
                    send(tensors)
                except Exception as exc:  # the engines' part: exported instead (see above)
                    failed = exc
        refused = confirm is not None and failed is None and not confirm()
        _, n_failed = st.agree_counts(0, float(failed is not None or refused), self._dist)
        if not export and n_failed == 0:
            return failed, None
        return failed, self._local_export(out)

    def _local_export(self, out: Path, checkpoint: bool = False) -> Path:
        if self.lora is not None:
            return self._local_export_adapter(out, checkpoint)
        full = st.full_model_state(self.model)
        if self._dist is None or self._dist.rank == 0:
            ckpt.export_hf(self.model, self.tokenizer, out, state_dict=full)
        return out

    def _local_export_adapter(self, out: Path, checkpoint: bool) -> Path:
        """The adapter in peft's layout; a checkpoint adds the tokenizer and, with
        `merged_export`, the merged full model in `merged/`."""
        rank0 = self._dist is None or self._dist.rank == 0
        adapter = lo.adapter_state(self.model)
        if rank0:
            lo.save_adapter(self.model, out, adapter)
        if not checkpoint:
            return out
        if rank0 and self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(out))
        if self.lora.merged_export:
            full = st.full_model_state(self.model)
            if rank0:
                rebuild = None
                if self._dist is not None:
                    source, settings = self.model_source, self.lora
                    rebuild = lambda: lo.wrap_with_lora(source(), settings)  # noqa: E731
                lo.save_merged(self.model, out / lo.MERGED_DIR, full, self.tokenizer, rebuild)
        return out

    async def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler, RNG and counters; returns the extra state.

        A checkpoint written at any world size loads at any other: rank 0 reads the weights
        and every rank receives its shards; DCP reshards the optimizer state.
        """
        resolved = ckpt.resolve_checkpoint(path)
        return await self._submit(
            lambda: self._dispatch("load", None, {"path": resolved})[0][0]
        ).result()

    def _local_load(self, path: Path) -> dict[str, Any]:
        json_state, torch_state = ckpt.read_checkpoint_state(path)
        dcp_dir = path / ckpt.DCP_DIR
        if dcp_dir.is_dir():
            if not st.sharded_holds_model(dcp_dir):  # the HF export holds the weights
                self._local_load_hf_weights(path)
            st.load_sharded(self.model, self.optimizer, dcp_dir,
                            trainable_only=self.lora is not None)  # fmt: skip
        elif self._dist is None:  # written before DCP: optimizer in trainer_state.pt
            self._local_load_hf_weights(path)
            if self.optimizer is not None and "optimizer" in torch_state:
                self.optimizer.load_state_dict(torch_state["optimizer"])
        else:
            raise ckpt.CheckpointError(
                f"{path} predates sharded checkpoints (no {ckpt.DCP_DIR}/): resume it once "
                "with plain python, then under torchrun"
            )
        if self.scheduler is not None:
            self.scheduler.load_state_dict(torch_state["scheduler"])
        ckpt.set_rng_state(torch_state["rng"])
        self.step = int(json_state["step"])
        self.weight_version = int(json_state["weight_version"])
        self.model.zero_grad(set_to_none=True)
        return json_state["extra"]

    def _local_load_hf_weights(self, path: Path) -> None:
        """Weights ← the checkpoint's HF export (rank 0 reads it; the others get their shards)."""
        if self.lora is not None:
            raise ckpt.CheckpointError(
                f"{path} holds no LoRA adapter in {ckpt.DCP_DIR}/: it was written by a run "
                "without model.lora; resume it without model.lora"
            )
        rank0 = self._dist is None or self._dist.rank == 0
        full = ckpt.read_hf_weights(path) if rank0 else None
        st.load_full_weights(self.model, full, self._dist, source=path)
