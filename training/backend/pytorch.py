"""PyTorchTrainingBackend: owns model, optimizer, LR schedule, loss, device and step counters.

Contract:
- Tinker-style ordered futures. `forward_backward(samples)`, `optim_step()`, `forward(samples)`,
  `compute_logprobs(samples)` and `generate_greedy(...)` enqueue work and return a `TrainFuture`
  at once; `await fut.result()` gives the result. Work runs strictly in the order it was
  enqueued, on ONE worker thread, so torch never blocks the trio event loop and a
  `forward_backward` + `optim_step` pair can be queued back to back.
- A `forward_backward` splits its samples into micro-batches by a token budget and accumulates
  gradients; the loss is normalised over the whole call (by default per trained token), so the
  gradient does not depend on the micro-batch size — nor on the number of processes.
- After any operation fails, every later one fails too (naming the first error): gradients of
  a half-done step are never applied.
- `save_checkpoint` writes HF layout + trainer state atomically (see training/backend/checkpoint.py).

Any world size, one code path. Under torchrun (training/distributed) every rank builds the
same backend with its model sharded by FSDP2; each operation is a named op that rank 0 sends
to the other ranks with their token-balanced share of the rows (`_dispatch`), every rank runs
its part (`run_local`), and rank 0 combines the results (both, and the passes each op runs, in
training/backend/rank_ops.py; checkpoint I/O in training/backend/persistence.py). At world size 1 `_dispatch` runs the
op on all the rows and combines the one result: the same functions either way. What must be
the same on every rank is: the loss normaliser (all-reduced before backward), the number of
forward passes (agreed before the first one, in the same all-reduce; ranks with fewer
micro-batches then run idle ones: training/backend/rank_ops.py), and the gradient norm (FSDP's
DTensors give the global one).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from training.backend import lora as lo
from training.backend import micro_batch_auto
from training.backend import state as st
from training.backend.futures import BackendError as BackendError
from training.backend.futures import TrainFuture
from training.backend.model_io import load_model as load_model
from training.backend.model_io import load_model_and_tokenizer as load_model_and_tokenizer
from training.backend.model_io import load_tokenizer as load_tokenizer
from training.backend.optim import (
    OptimizerFactory,
    SchedulerFactory,
    default_optimizer,
    default_scheduler,
)
from training.backend.persistence import StateOps
from training.backend.rank_ops import RankOps
from training.backend.state import Mean as Mean
from training.backend.state import merge_metrics as merge_metrics
from training.config import LoraSettings, OptimConfig
from training.data.logprob_head import DEFAULT_CHUNK_TOKENS, TemperedLogprobs
from training.data.packing import sft_loss
from training.distributed import context as dctx
from training.distributed.split import even_shares
from training.distributed.wire import SentById
from training.distributed.worker import issue

R = TypeVar("R")
LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict[str, float | Mean]]]
CollateFn = Callable[[Sequence[Any]], Any]


def trained_tokens(batch: Any) -> float:
    """The default loss weight of a micro-batch: its number of trained tokens."""
    return batch.n_trained_tokens


def tempered_logprobs(logits: torch.Tensor, batch: Any, *, temperature: float) -> torch.Tensor:
    """[B, T] logprobs of the target tokens under logits / temperature (the logits path)."""
    return TemperedLogprobs(temperature)(logits, batch)


def first_output(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """[B, T] of a one-output-per-token model (a critic's values)."""
    return logits[..., 0]


class PyTorchTrainingBackend(RankOps, StateOps, SentById):
    """Training state of one model; see the module docstring for the contract."""

    def __init__(
        self,
        model: torch.nn.Module | Callable[[], torch.nn.Module] | None,
        tokenizer: Any,
        *,
        optim: OptimConfig,
        max_steps: int,
        checkpoint_dir: str | Path,
        micro_batch_tokens: int | str = "auto",
        pack_length: int | None = 256,
        loss_fn: LossFn = sft_loss,
        collate_fn: CollateFn | None = None,
        loss_weight_fn: Callable[[Any], float] = trained_tokens,
        keep_last: int | None = 2,
        num_threads: int | None = None,
        seed: int = 0,
        frozen: bool = False,
        weights_from: PyTorchTrainingBackend | None = None,
        lora: LoraSettings | None = None,
        optimizer_factory: OptimizerFactory = default_optimizer,
        scheduler_factory: SchedulerFactory = default_scheduler,
        auto_reserve_params: float = 0.0,
        _backend_id: int | None = None,
    ):
        """Args:
        model: the model, or a zero-argument callable that builds/loads it. A callable runs
            on the backend's worker thread, so that every torch op of the trainer runs on
            that one thread (a second thread running OpenMP-parallel ops slows both, see
            plumbing/threads.py). The recipes pass `partial(load_model, path)`. Under
            torchrun it must be a callable that every rank can rebuild (a module-level
            function or a partial of one). None with `weights_from`: a copy of that backend's
            model (the reference policy).
        micro_batch_tokens: a micro-batch's token budget, or "auto" (the largest the device's
            free memory holds, less `auto_reserve_params` x the params: micro_batch_auto.py).
        frozen: no gradients and no optimizer (a reference policy).
        weights_from: start from this backend's current weights.
        lora: wrap the model with these LoRA adapters (training/backend/lora.py): only they
            train, checkpoints and weight pushes hold only them, and the base model (adapters
            off) serves as the reference policy (`compute_logprobs(..., base_model=True)`).
        optimizer_factory, scheduler_factory: build the optimizer and LR schedule (default:
            as `optim` says, AdamW or SGD and warmup + cosine/constant); checkpointed and
            resumed alike (training/backend/optim.py).
        """
        self._dist = dctx.current()
        self._failed: BaseException | None = None
        self._closed = False
        self._own_executor: ThreadPoolExecutor | None = None
        if self._dist is None:
            self._own_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        self._executor = self._own_executor or (self._dist.executor if self._dist else None)
        self.backend_id = self._dist.register(self, _backend_id) if self._dist else 0
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        self.model_source = (
            model if model is None or not isinstance(model, torch.nn.Module) else None
        )
        self.tokenizer = tokenizer
        self.optim_config = optim
        self.checkpoint_dir = Path(checkpoint_dir)
        self.micro_batch_tokens = micro_batch_tokens
        self.pack_length = pack_length
        self.loss_fn = loss_fn
        self.loss_weight_fn = loss_weight_fn
        # tokens per chunk of the fused logprob head (training/data/logprob_head.py)
        self.logprob_chunk_tokens = DEFAULT_CHUNK_TOKENS
        self.collate_fn = collate_fn
        self.keep_last = keep_last
        self.lora = lora
        self.pad_id = tokenizer.pad_token_id
        self._collate = collate_fn or self._collate_sft
        spec = dict(
            model=self.model_source, tokenizer=getattr(tokenizer, "name_or_path", None),
            optim=optim, max_steps=max_steps, checkpoint_dir=self.checkpoint_dir,
            micro_batch_tokens=micro_batch_tokens, pack_length=pack_length, loss_fn=loss_fn,
            collate_fn=collate_fn, loss_weight_fn=loss_weight_fn, keep_last=keep_last,
            num_threads=num_threads, seed=seed, frozen=frozen, weights_from=weights_from,
            lora=lora, optimizer_factory=optimizer_factory, scheduler_factory=scheduler_factory,
            auto_reserve_params=auto_reserve_params,
        )  # fmt: skip

        def init_worker() -> torch.nn.Module:
            if self._dist is not None and self._dist.rank == 0:
                if isinstance(model, torch.nn.Module):
                    raise TypeError("under torchrun pass the model as a builder (e.g. "
                                    "partial(load_model, path)), not a built module")  # fmt: skip
                build = type(self).build_on_worker  # by import path: worker.py imports no backend
                issue(self._dist, "create", self.backend_id, {"build": build, "spec": spec})
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            torch.manual_seed(seed)
            built = self._build_model(model, frozen, weights_from)
            self.micro_batch_tokens = micro_batch_auto.resolve_for(  # on every rank alike
                self, built, micro_batch_tokens, optimizer_factory, auto_reserve_params
            )
            return built

        model = self._executor.submit(init_worker).result() if self._executor else init_worker()
        self.model = model
        self.device = next(model.parameters()).device
        trainable = [p for p in model.parameters() if p.requires_grad]
        # A frozen model (a reference policy) gets no optimizer; it only answers queries.
        self.optimizer = optimizer_factory(trainable, optim) if trainable else None
        self.scheduler = (
            scheduler_factory(self.optimizer, optim, max_steps)
            if self.optimizer is not None
            else None
        )
        self.step = 0
        self.weight_version = 0
        model.train()

    @classmethod
    def build_on_worker(cls, spec: dict[str, Any], backend_id: int) -> PyTorchTrainingBackend:
        """Ranks ≥ 1: the backend rank 0 announced (same arguments, same id)."""
        return cls(**spec, _backend_id=backend_id)

    def _build_model(self, model: Any, frozen: bool, weights_from: Any) -> torch.nn.Module:
        if isinstance(model, torch.nn.Module):
            built = model
        elif model is None and weights_from is None:
            raise ValueError("model=None needs weights_from (the backend to copy)")
        elif model is None and self._dist is None:
            built = copy.deepcopy(weights_from.model)  # one process: no need to reload it
        else:
            source = model if model is not None else weights_from.model_source
            if source is None:
                raise TypeError("under torchrun the copied backend must have a model builder")
            built = source()
        if self.lora is not None:
            if frozen or weights_from is not None:
                raise ValueError(
                    "a LoRA backend is a trained policy: its reference is its own "
                    "base model (compute_logprobs(base_model=True)), not a copy"
                )
            built = lo.wrap_with_lora(built, self.lora)
        if frozen:
            built.eval()
            for p in built.parameters():
                p.requires_grad_(False)
        if self._dist is not None:
            dctx.shard_model(built, self._dist)
            if weights_from is not None:  # same sharding: each rank copies its own shards
                st.copy_params(built, weights_from.model)
        return built

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        return self._dist is not None

    def close(self) -> None:
        """Wait for queued work to finish, then let this backend go: its own worker thread
        stops; under torchrun every rank unregisters it (the job's shared thread stays), so
        its model and optimizer are freed once the caller drops it, not at the job's end.
        Later operations raise BackendError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._own_executor is not None:
            self._own_executor.shutdown(wait=True)
        elif self._dist is not None and self._dist.backends.get(self.backend_id) is self:
            assert self._executor is not None, "ranks ≥ 1 release through serve_commands"
            self._executor.submit(self._release).result()

    def _release(self) -> None:
        """Rank 0, on the job's thread: tell the other ranks to drop this backend, and drop it.
        Not the other ranks after a failure: they may be gone, and the job is ending."""
        assert self._dist is not None
        if self._failed is None:
            issue(self._dist, "release", self.backend_id, {})
        self._dist.unregister(self.backend_id)

    def __enter__(self) -> PyTorchTrainingBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, fn: Callable[[], R]) -> TrainFuture[R]:
        if self._closed:
            raise BackendError("this backend was closed (close()): build another to go on")

        def guarded() -> R:
            if self._failed is not None:
                raise BackendError(f"an earlier backend operation failed: {self._failed!r}")
            try:
                return fn()
            except BaseException as err:
                self._failed = err
                raise

        assert self._executor is not None, "ranks ≥ 1 run operations through serve_commands"
        return TrainFuture(self._executor.submit(guarded))

    def call(self, fn: Callable[[], R]) -> TrainFuture[R]:
        """Queue any function on the trainer thread (e.g. a reference-model update rule).

        Under torchrun it runs on rank 0 only: it must change weights through the backend's
        collective methods (`copy_weights_from`, `lerp_weights_from`, `full_state`,
        `load_weights_from_checkpoint`), which are safe to call from inside `fn`.
        """
        return self._submit(fn)

    # -- queued operations ------------------------------------------------------------------------

    def forward_backward(
        self,
        samples: Sequence[Any],
        *,
        loss_fn: LossFn | None = None,
        loss_weight_fn: Callable[[Any], float] | None = None,
        dropout: bool = True,
    ) -> TrainFuture[dict[str, float]]:
        """Queue forward + backward over `samples`; gradients accumulate until `optim_step`.

        `loss_fn` / `loss_weight_fn` replace the backend's defaults for this call (e.g. the RL
        loss of this step's algorithm). Loss metrics merge over micro-batches and ranks by
        `training.backend.state.merge_rule`: a `max` / `min` word takes the extreme, counts
        (`num_*`) add, means are weighted by their own units (a `state.Mean`) or else by the
        loss's weights, so the metrics do not depend on micro-batching or world size.
        `dropout=False` sets every dropout probability to 0 for this call (RL: the loss pass
        then computes the same logprobs as the old-policy and reference passes, which run in
        eval mode; see training/rl/step.py).
        """
        samples = list(samples)
        args = {
            "loss_fn": loss_fn or self.loss_fn,
            "weight_fn": loss_weight_fn or self.loss_weight_fn,
            "dropout": dropout,
        }

        def run() -> dict[str, float]:
            results, _ = self._dispatch("forward_backward", samples, args, gather=True)
            return st.combine_step_metrics(results)

        return self._submit(run)

    def optim_step(self, *, finish_step: bool = True) -> TrainFuture[dict[str, float]]:
        """Queue clip + optimizer step, then (with `finish_step`) the LR schedule step and
        the bump of `step` and `weight_version`.

        Several updates on one RL batch (mini-batches, epochs) pass `finish_step=False` to all
        but the last: the schedule and the versions count training steps, and the weights the
        engines see are those after the step's last update.
        """
        return self._submit(
            lambda: self._dispatch("optim_step", None, {"finish_step": finish_step})[0][0]
        )

    def forward(self, samples: Sequence[Any]) -> TrainFuture[dict[str, float]]:
        """Queue a no-grad loss evaluation (held-out loss), token-weighted over `samples`."""
        samples = list(samples)

        def run() -> dict[str, float]:
            results, _ = self._dispatch("forward", samples, {}, gather=True)
            return {"loss": sum(results), "n_samples": len(samples)}

        return self._submit(run)

    def compute_logprobs(
        self, samples: Sequence[Any], *, temperature: float = 1.0, base_model: bool = False
    ) -> TrainFuture[list[torch.Tensor]]:
        """Queue per-sample logprobs of every trained target token, in sample order.

        `temperature` scales the logits first (`temper_logits`): pass the sampling temperature
        so that these logprobs (reference, old policy) are comparable with the policy's in the
        RL loss and with the engine's. `base_model`: with the LoRA adapters off (the frozen
        base: a LoRA policy's reference); the same as False without LoRA.
        """
        fn = TemperedLogprobs(temperature)  # through the fused head (logprob_head.py)
        return self._per_trained_token(samples, fn, base_model=base_model)

    def compute_values(self, samples: Sequence[Any]) -> TrainFuture[list[torch.Tensor]]:
        """Queue per-sample outputs of a one-output-per-token model (a critic, see
        training/rl/critic.py) at every trained target position, in sample order."""
        return self._per_trained_token(samples, first_output)

    def _per_trained_token(self, samples: Sequence[Any], fn, *,
                           base_model: bool = False) -> TrainFuture[list[torch.Tensor]]:  # fmt: skip
        samples = list(samples)
        args = {"fn": fn, "base_model": base_model}

        def run() -> list[torch.Tensor]:
            results, shares = self._dispatch("per_trained_token", samples, args, gather=True)
            out: list[torch.Tensor | None] = [None] * len(samples)
            for share, values in zip(shares or [], results, strict=True):
                for i, v in zip(share, values, strict=True):
                    out[i] = v
            return out  # type: ignore[return-value]

        return self._submit(run)

    def generate_greedy(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int = 256
    ) -> TrainFuture[list[list[int]]]:
        """Queue greedy decoding of token-id prompts; returns the new token ids (eos included),
        in prompt order.

        Under torchrun the prompts are split across ranks (contiguous, even shares) and the
        answers gathered on rank 0.
        """
        rows = [list(p) for p in prompts]
        args = {"max_new_tokens": max_new_tokens, "batch_size": batch_size}

        def run() -> list[list[int]]:
            shares = even_shares(len(rows), self._dist.world if self._dist else 1)
            results, _ = self._dispatch("generate_greedy", rows, args, gather=True,
                                        shares=shares)  # fmt: skip
            return [ids for part in results for ids in part]

        return self._submit(run)
