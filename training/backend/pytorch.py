"""PyTorchTrainingBackend: owns model, optimizer, LR schedule, loss, device and step counters.

Contract:
- Tinker-style ordered futures. `forward_backward(samples)`, `optim_step()`, `forward(samples)`,
  `compute_logprobs(samples)` and `generate_greedy(...)` enqueue work and return a `TrainFuture`
  at once; `await fut.result()` gives the result. Work runs strictly in the order it was
  enqueued, on ONE worker thread, so torch never blocks the trio event loop and a
  `forward_backward` + `optim_step` pair can be queued back to back.
- A `forward_backward` splits its samples into micro-batches by a token budget and accumulates
  gradients; the loss is normalised over the whole call (by default per trained token), so the
  gradient does not depend on the micro-batch size.
- After any operation fails, every later one fails too (naming the first error): gradients of
  a half-done step are never applied.
- `save_checkpoint` writes HF layout + trainer state atomically (see training/backend/checkpoint.py).

Not covered: multi-process data parallelism (one process, one device).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from rollouts.errors import RolloutsError
from training.backend import checkpoint as ckpt
from training.backend.futures import TrainFuture, lr_lambda
from training.backend.model_io import eval_mode, generate_greedy
from training.backend.model_io import load_model as load_model
from training.backend.model_io import load_model_and_tokenizer as load_model_and_tokenizer
from training.backend.model_io import load_tokenizer as load_tokenizer
from training.config import OptimConfig
from training.data.packing import (
    forward_logits,
    pack_balanced,
    prepare_sft_batch,
    sft_loss,
    temper_logits,
    token_logprobs,
)
from training.data.prefix_sharing import split_rows_by_budget

R = TypeVar("R")
LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict[str, float]]]
CollateFn = Callable[[Sequence[Any]], Any]


class BackendError(RolloutsError, RuntimeError):
    """A backend operation failed, or an earlier one did and the backend refuses to go on."""


class PyTorchTrainingBackend:
    """Training state of one model; see the module docstring for the contract."""

    def __init__(
        self,
        model: torch.nn.Module | Callable[[], torch.nn.Module],
        tokenizer: Any,
        *,
        optim: OptimConfig,
        max_steps: int,
        checkpoint_dir: str | Path,
        micro_batch_tokens: int = 8192,
        pack_length: int | None = 256,
        loss_fn: LossFn = sft_loss,
        collate_fn: CollateFn | None = None,
        loss_weight_fn: Callable[[Any], float] = lambda batch: batch.n_trained_tokens,
        keep_last: int | None = 2,
        num_threads: int | None = None,
        seed: int = 0,
    ):
        """Args:
        model: the model, or a zero-argument callable that builds/loads it. A callable runs
            on the backend's worker thread, so that every torch op of the trainer runs on
            that one thread (a second thread running OpenMP-parallel ops slows both, see
            rollouts/threads.py). The recipes pass `lambda: load_model(path)`.
        """
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        self._failed: BaseException | None = None

        def init_worker() -> torch.nn.Module:
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            torch.manual_seed(seed)
            return model() if callable(model) and not isinstance(model, torch.nn.Module) else model

        model = self._executor.submit(init_worker).result()
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.optim_config = optim
        self.checkpoint_dir = Path(checkpoint_dir)
        self.micro_batch_tokens = micro_batch_tokens
        self.pack_length = pack_length
        self.loss_fn = loss_fn
        self.loss_weight_fn = loss_weight_fn
        self.keep_last = keep_last
        self.pad_id = tokenizer.pad_token_id
        self._collate = collate_fn or self._collate_sft
        trainable = [p for p in model.parameters() if p.requires_grad]
        # A frozen model (a reference policy) gets no optimizer; it only answers queries.
        self.optimizer = (
            torch.optim.AdamW(
                trainable,
                lr=optim.lr,
                betas=optim.betas,
                eps=optim.eps,
                weight_decay=optim.weight_decay,
                # One fused kernel instead of ~10 ops per tensor: 7.1 -> 2.1 ms per step on the
                # tiny model (1 thread), a few % of a GRPO step. Same update up to rounding
                # (opt-in: the rounding moved the tiny SFT recipe from 47 % to 83 % held-out).
                fused=optim.fused and _fused_adam_ok(trainable),
            )
            if trainable
            else None
        )
        self.scheduler = (
            torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, max_steps))
            if self.optimizer is not None
            else None
        )
        self.step = 0
        self.weight_version = 0
        model.train()

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for queued work to finish and stop the worker thread."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> PyTorchTrainingBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, fn: Callable[[], R]) -> TrainFuture[R]:
        def guarded() -> R:
            if self._failed is not None:
                raise BackendError(f"an earlier backend operation failed: {self._failed!r}")
            try:
                return fn()
            except BaseException as err:
                self._failed = err
                raise

        return TrainFuture(self._executor.submit(guarded))

    def call(self, fn: Callable[[], R]) -> TrainFuture[R]:
        """Queue any function of the model (e.g. a reference-model update) on the worker."""
        return self._submit(fn)

    # -- batching -------------------------------------------------------------------------------

    def _collate_sft(self, samples: Sequence[Any]) -> Any:
        packing = self.pack_length is not None
        return prepare_sft_batch(
            samples, pad_id=self.pad_id, packing=packing, max_tokens_per_row=self.pack_length
        )

    def split_microbatches(self, samples: Sequence[Any]) -> list[list[Any]]:
        """Group samples into micro-batches of at most `micro_batch_tokens` padded slots."""
        if self.pack_length is not None:
            rows = pack_balanced(samples, self.pack_length)
            rows_per_mb = max(1, self.micro_batch_tokens // self.pack_length)
            return [
                [samples[i] for row in rows[k : k + rows_per_mb] for i in row]
                for k in range(0, len(rows), rows_per_mb)
            ]
        # One row per sample, or per run of samples sharing a prompt (RL examples with
        # `shared_prefix_len`); samples sharing a `unit` (e.g. a DPO pair) stay together.
        # Micro-batches are consecutive whole rows, so collating one re-plans the same rows.
        return split_rows_by_budget(samples, self.micro_batch_tokens)

    # -- queued operations ------------------------------------------------------------------------

    def forward_backward(
        self,
        samples: Sequence[Any],
        *,
        loss_fn: LossFn | None = None,
        loss_weight_fn: Callable[[Any], float] | None = None,
    ) -> TrainFuture[dict[str, float]]:
        """Queue forward + backward over `samples`; gradients accumulate until `optim_step`.

        `loss_fn` / `loss_weight_fn` replace the backend's defaults for this call (e.g. the RL
        loss of this step's algorithm). Loss metrics are averaged over micro-batches with the
        same weights as the loss; keys ending in `_max` / `_min` take the maximum / minimum.
        """
        samples = list(samples)
        fn = loss_fn or self.loss_fn
        weight_fn = loss_weight_fn or self.loss_weight_fn
        return self._submit(lambda: self._forward_backward(samples, fn, weight_fn))

    def _forward_backward(self, samples: list[Any], loss_fn: LossFn, weight_fn) -> dict[str, float]:
        t0 = time.perf_counter()
        batches = [self._collate(mb) for mb in self.split_microbatches(samples)]
        total_weight = sum(weight_fn(b) for b in batches)
        if total_weight <= 0:
            raise BackendError("forward_backward got a batch with no trained tokens")
        merged: dict[str, float] = {}
        n_tokens = n_slots = n_trained = 0
        for batch in batches:
            logits = forward_logits(self.model, batch.to(self.device))
            loss, metrics = loss_fn(logits, batch)
            weight = weight_fn(batch) / total_weight
            (loss * weight).backward()
            merge_metrics(merged, {**metrics, "loss": loss.item()}, weight)
            n_tokens += batch.n_tokens
            n_slots += batch.n_slots
            n_trained += batch.n_trained_tokens
        return {
            **merged,
            "n_samples": len(samples),
            "n_tokens": n_tokens,
            "n_trained_tokens": n_trained,
            "padding_efficiency": n_tokens / max(1, n_slots),
            "n_microbatches": len(batches),
            "time_forward_backward_s": time.perf_counter() - t0,
        }

    def optim_step(self, *, finish_step: bool = True) -> TrainFuture[dict[str, float]]:
        """Queue clip + optimizer step, then (with `finish_step`) the LR schedule step and
        the bump of `step` and `weight_version`.

        Several updates on one RL batch (mini-batches, epochs) pass `finish_step=False` to all
        but the last: the schedule and the versions count training steps, and the weights the
        engines see are those after the step's last update.
        """
        return self._submit(lambda: self._optim_step(finish_step))

    def _optim_step(self, finish_step: bool = True) -> dict[str, float]:
        if self.optimizer is None or self.scheduler is None:
            raise BackendError("this backend's model has no trainable parameters (a reference?)")
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.optim_config.grad_clip
        max_norm = clip if clip is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if finish_step:
            self.scheduler.step()
            self.step += 1
            self.weight_version += 1
        return {"grad_norm": grad_norm, "lr": lr, "step": self.step}

    def forward(self, samples: Sequence[Any]) -> TrainFuture[dict[str, float]]:
        """Queue a no-grad loss evaluation (held-out loss), token-weighted over `samples`."""
        samples = list(samples)
        return self._submit(lambda: self._forward(samples))

    def _forward(self, samples: list[Any]) -> dict[str, float]:
        batches = [self._collate(mb) for mb in self.split_microbatches(samples)]
        total_weight = sum(self.loss_weight_fn(b) for b in batches)
        loss_sum = 0.0
        with torch.no_grad(), eval_mode(self.model):
            for batch in batches:
                loss, _ = self.loss_fn(forward_logits(self.model, batch.to(self.device)), batch)
                loss_sum += loss.item() * self.loss_weight_fn(batch) / max(total_weight, 1e-12)
        return {"loss": loss_sum, "n_samples": len(samples)}

    def compute_logprobs(
        self, samples: Sequence[Any], *, temperature: float = 1.0
    ) -> TrainFuture[list[torch.Tensor]]:
        """Queue per-sample logprobs of every trained target token, in sample order.

        `temperature` scales the logits first (`temper_logits`): pass the sampling temperature
        so that these logprobs (reference, old policy) are comparable with the policy's in the
        RL loss and with the engine's.
        """
        samples = list(samples)

        def logprobs(logits: torch.Tensor, batch: Any) -> torch.Tensor:
            return token_logprobs(temper_logits(logits, temperature), batch.target_ids)

        return self._submit(lambda: self._per_trained_token(samples, logprobs))

    def compute_values(self, samples: Sequence[Any]) -> TrainFuture[list[torch.Tensor]]:
        """Queue per-sample outputs of a one-output-per-token model (a critic, see
        training/rl/critic.py) at every trained target position, in sample order."""
        samples = list(samples)
        return self._submit(lambda: self._per_trained_token(samples, lambda lg, _: lg[..., 0]))

    def _per_trained_token(self, samples: list[Any], fn) -> list[torch.Tensor]:
        """`fn(logits, batch)` → [B, T], read at each sample's trained positions (no grad)."""
        out: list[torch.Tensor] = []
        with torch.no_grad(), eval_mode(self.model):
            for mb in self.split_microbatches(samples):
                batch = self._collate(mb).to(self.device)
                values_BT = fn(forward_logits(self.model, batch), batch)
                trained = batch.target_ids != -100
                for i in range(len(mb)):
                    sel = (batch.segment_ids == i) & trained
                    out.append(values_BT[sel].float().cpu())
        return out

    def generate_greedy(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int = 256
    ) -> TrainFuture[list[list[int]]]:
        """Queue greedy decoding of token-id prompts; returns the new token ids (eos included)."""
        prompts = [list(p) for p in prompts]
        return self._submit(
            lambda: generate_greedy(self.model, self.tokenizer, prompts, max_new_tokens, batch_size)
        )

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
        gives the latter back.
        """
        return await self._submit(
            lambda: self._save(step, metrics, extra_state or {}, extra_tensors or {})
        ).result()

    def _save(self, step: int, metrics: dict[str, Any], extra: dict[str, Any],
              extra_tensors: dict[str, Any]) -> Path:  # fmt: skip
        if self.optimizer is None or self.scheduler is None:
            raise BackendError("a frozen backend (no optimizer) is not checkpointed")
        torch_state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": ckpt.rng_state(),
            "extra": extra_tensors,
        }
        json_state = {
            "step": self.step,
            "weight_version": self.weight_version,
            "metrics": metrics,
            "extra": extra,
        }
        return ckpt.write_checkpoint(
            self.checkpoint_dir,
            step,
            model=self.model,
            tokenizer=self.tokenizer,
            torch_state=torch_state,
            json_state=json_state,
            keep_last=self.keep_last,
        )

    @staticmethod
    def read_extra_tensors(path: str | Path) -> dict[str, Any]:
        """The `extra_tensors` saved with the checkpoint at `path` ({} if none were)."""
        _, torch_state = ckpt.read_checkpoint_state(ckpt.resolve_checkpoint(path))
        return dict(torch_state.get("extra", {}))

    async def export_weights(self, out_dir: str | Path) -> Path:
        """Write the current weights in HF layout (what engines load) after queued work."""
        out = Path(out_dir)
        return await self._submit(lambda: ckpt.export_hf(self.model, self.tokenizer, out)).result()

    async def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler, RNG and counters; returns the extra state."""
        resolved = ckpt.resolve_checkpoint(path)
        return await self._submit(lambda: self._load(resolved)).result()

    def _load(self, path: Path) -> dict[str, Any]:
        json_state, torch_state = ckpt.read_checkpoint_state(path)
        ckpt.load_weights_into(self.model, path)
        if self.optimizer is not None and self.scheduler is not None:
            self.optimizer.load_state_dict(torch_state["optimizer"])
            self.scheduler.load_state_dict(torch_state["scheduler"])
        ckpt.set_rng_state(torch_state["rng"])
        self.step = int(json_state["step"])
        self.weight_version = int(json_state["weight_version"])
        self.model.zero_grad(set_to_none=True)
        return json_state["extra"]


def _fused_adam_ok(params: Sequence[torch.Tensor]) -> bool:
    """torch's fused AdamW runs floating-point parameters on CPU and CUDA."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def merge_metrics(into: dict[str, float], metrics: dict[str, Any], weight: float) -> None:
    """Add `weight` × each numeric metric into `into`; `_max` / `_min` keys keep the extreme."""
    for key, value in metrics.items():
        if not isinstance(value, int | float):
            continue
        if key.endswith("_max"):
            into[key] = max(into.get(key, float("-inf")), float(value))
        elif key.endswith("_min"):
            into[key] = min(into.get(key, float("inf")), float(value))
        else:
            into[key] = into.get(key, 0.0) + float(value) * weight
