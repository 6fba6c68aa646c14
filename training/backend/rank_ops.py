"""How a backend operation runs on every rank: dispatch, micro-batching, the `_local_*` parts,
and the one rule that keeps FSDP's collectives matched across ranks.

A mixin of `PyTorchTrainingBackend` (training/backend/pytorch.py), which keeps construction,
the ordered queue and the public operations; the passes they execute are here. `_dispatch`
sends an op with each rank's rows; `run_local` calls the method named `_local_<op>` on every
rank, in the same order everywhere; `on_every_rank(fn)` runs a function of the process (not of
the model) on every rank in queue order.

The rule for every op that runs forward passes (loss, forward-backward, logprobs, values,
greedy decoding, anything added later): FSDP all-gathers the parameters in each forward (and
reduce-scatters the gradients in each backward), so every rank must run the same number of
passes, though the token-budget split gives ranks different numbers of micro-batches. So an op

1. agrees its pass count FIRST, in one collective (`_agree_passes`: every rank's count, and
   the loss normaliser when the op has one, in the same all-reduce), and only then
2. runs its own micro-batches followed by idle passes up to the agreed count (`_passes`).

Agreeing after the rank's own passes instead deadlocks: a rank with fewer micro-batches enters
the count's all-reduce while a busier one waits in its next pass's all-gather (issue 24).
At world size 1 the agreement is the identity and there are no idle passes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from training.backend import lora as lo
from training.backend import model_io
from training.backend import state as st
from training.backend.futures import BackendError, TrainFuture
from training.data.logprob_head import forward_scores
from training.data.packing import (
    IGNORE_INDEX,
    forward_logits,
    move_to,
    pack_balanced,
    prepare_sft_batch,
)
from training.data.prefix_sharing import split_rows_by_budget
from training.data.scores import ReadsScores, TokenScores
from training.distributed import watchdog
from training.distributed.accumulation import gathered_for_op
from training.distributed.split import even_shares, rank_shares
from training.distributed.worker import gather_results, issue

if TYPE_CHECKING:
    from training.backend.pytorch import LossFn

T = TypeVar("T")


class RankOps:
    """`_dispatch`, `run_local`, micro-batching and the `_local_*` parts of each operation."""

    # -- dispatch: one op on every rank -----------------------------------------------------------

    def _dispatch(self, op: str, rows: list[Any] | None, args: dict[str, Any], *,
                  gather: bool = False, shares: list[list[int]] | None = None,
                  ) -> tuple[list[Any], list[list[int]] | None]:  # fmt: skip
        """Run `op` on every rank (rank 0: on the trainer thread); (results by rank, shares).

        Rows are split token-balanced across ranks unless `shares` (indices into `rows` for
        each rank) says how; `results` holds every rank's local result when `gather`, else
        rank 0's only.
        """
        ctx = self._dist
        if ctx is None:
            shares = None if rows is None else [list(range(len(rows)))]
            return [self.run_local(op, rows, args)], shares
        if rows is not None and shares is None:
            shares = rank_shares(rows, ctx.world, packed=self.pack_length is not None)
        per_rank = None if shares is None else [[rows[i] for i in share] for share in shares]
        with self._watching(op):  # the sends and the gather too: a silent rank blocks them
            self._phase("sending the op to the other ranks")
            issue(ctx, op, self.backend_id, args, per_rank, gather=gather)
            local = self.run_local(op, None if per_rank is None else per_rank[0], args)
            self._phase("gathering the other ranks' results")
            return (gather_results(ctx, local) if gather else [local]), shares

    def run_local(self, op: str, rows: list[Any] | None, args: dict[str, Any]) -> Any:
        """This rank's part of `op` (every rank runs it, in the same order)."""
        fn = getattr(self, f"_local_{op}")
        with self._watching(op):
            return fn(rows, **args) if rows is not None else fn(**args)

    def on_every_rank(self, fn: Callable[[], T]) -> TrainFuture[list[T]]:
        """Queue `fn()` on every rank, in queue order; every rank's result, in rank order.

        For work of the process rather than of the model, which every rank must do for its own
        (e.g. `device_memory.give_back`: each rank's caching allocator holds its own freed
        activations). `fn` crosses to the other ranks by import path (a module-level function,
        or a partial of one) and its result back as the wire encodes it (training/distributed/
        wire.py). At world size 1: `[fn()]`, on the trainer thread.
        """
        return self._submit(lambda: self._dispatch("on_every_rank", None, {"fn": fn},
                                                   gather=True)[0])  # fmt: skip

    def _local_on_every_rank(self, fn: Callable[[], T]) -> T:
        return fn()

    # -- batching -------------------------------------------------------------------------------

    def _collate_sft(self, samples: Sequence[Any]) -> Any:
        packing = self.pack_length is not None
        return prepare_sft_batch(
            samples, pad_id=self.pad_id, packing=packing, max_tokens_per_row=self.pack_length
        )

    def split_microbatches(self, samples: Sequence[Any]) -> list[list[Any]]:
        """Group samples into micro-batches of at most `micro_batch_tokens` padded slots."""
        if not samples:
            return []
        if self.pack_length is not None:
            # the fewest micro-batches of `rows_per_mb` rows, as equal as whole rows allow (16
            # rows at 15 per micro-batch: 8 + 8, not 15 + 1); the rows hold equal tokens
            rows = pack_balanced(samples, self.pack_length)
            rows_per_mb = max(1, self.micro_batch_tokens // self.pack_length)
            parts = even_shares(len(rows), -(-len(rows) // rows_per_mb))
            return [[samples[i] for r in part for i in rows[r]] for part in parts]
        # One row per sample, or per run of samples sharing a prompt (RL examples with
        # `shared_prefix_len`); samples sharing a `unit` (e.g. a DPO pair) stay together.
        # Micro-batches are consecutive whole rows, so collating one re-plans the same rows.
        return split_rows_by_budget(samples, self.micro_batch_tokens)

    # -- the pass-count rule (see the module docstring) --------------------------------------------

    def _agree_passes(self, n_local: int, weight: float = 0.0) -> tuple[int, float]:
        """(the largest pass count of any rank, the sum of `weight` over ranks), in one
        collective issued before any pass of the op."""
        self._phase(f"agreeing pass counts (this rank: {n_local})")
        counts, total_weight = st.agree_counts(n_local, weight, self._dist)
        self._counts = counts
        return max(counts), total_weight

    @contextlib.contextmanager
    def _watching(self, op: str) -> Iterator[None]:
        """The op's status on the watchdog's board (training/distributed/watchdog.py); nested
        calls (rank 0's `_dispatch` around its own `run_local`) join the outer one."""
        if getattr(self, "_watch", None) is not None:
            yield
            return
        step = self.step + 1 if self.optimizer is not None else None  # the step in progress
        try:
            with watchdog.watch(self._dist, op, step) as self._watch:
                yield
        finally:
            self._watch = None

    def _phase(self, text: str) -> None:
        """Record this rank's progress through the op (what the watchdog reports)."""
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.phase(text)

    def _gathered(self) -> contextlib.AbstractContextManager:
        """FSDP keeps the params gathered across the op's passes (training/distributed/
        accumulation.py); yields its `GatheredOp`, or None when that is off or not sharded."""
        fsdp = self._dist.fsdp if self._dist is not None else None
        return gathered_for_op(self.model, enabled=fsdp is not None and fsdp.accumulate_unsharded,
                               reshard_after_forward=fsdp is None or fsdp.reshard_after_forward)  # fmt: skip

    def _passes(self, items: Sequence[T], n_agreed: int, idle: Callable[[], object],
                gathered: Any = None) -> Iterator[T]:  # fmt: skip
        """Yield this rank's `items` (the caller runs one pass on each), then run `idle()`
        until the rank has made `n_agreed` passes; `gathered` (a `GatheredOp`) is told of
        each pass before it runs, so that only the last one reduces the gradients."""
        if n_agreed < len(items):
            raise BackendError(f"agreed on {n_agreed} passes but this rank has {len(items)}")
        counts = getattr(self, "_counts", None)
        of = f"of {n_agreed}" + (f" (passes by rank: {counts})" if counts else "")
        for k, item in enumerate(items):
            self._phase(f"pass {k + 1} {of}")
            if gathered is not None:
                gathered.before_pass(k, n_agreed)
            yield item
        for k in range(len(items), n_agreed):
            self._phase(f"idle pass {k + 1} {of}")
            if gathered is not None:
                gathered.before_pass(k, n_agreed)
            idle()

    def _idle_pass(self, *, backward: bool) -> None:
        """A forward (and backward) pass on one pad token: the same collectives as a real one,
        no effect on the gradient (its loss is multiplied by 0)."""
        ids = torch.full((1, 1), self.pad_id or 0, dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward):
            logits = self.model(input_ids=ids).logits
            if backward:
                (logits.float().sum() * 0.0).backward()

    def _forward_for(self, batch: Any, consumer: Any) -> torch.Tensor | TokenScores:
        """What `consumer` (a loss or per-token reader) reads: the fused head's `TokenScores`
        (training/data/logprob_head.py) for a `ReadsScores`, else [B, T, V] logits."""
        if isinstance(consumer, ReadsScores):
            return forward_scores(self.model, batch, temperature=consumer.temperature,
                                  entropy=consumer.wants_entropy,
                                  chunk_tokens=self.logprob_chunk_tokens)  # fmt: skip
        return forward_logits(self.model, batch)

    # -- the ops -----------------------------------------------------------------------------------

    def _local_forward_backward(self, samples: list[Any], loss_fn: LossFn, weight_fn,
                                dropout: bool = True) -> dict:  # fmt: skip
        t0 = time.perf_counter()
        # every micro-batch copied at the start (non-blocking from pinned memory on a GPU)
        batches = [self._collate(mb).to(self.device) for mb in self.split_microbatches(samples)]
        local_weight = float(sum(weight_fn(b) for b in batches))
        n_passes, total_weight = self._agree_passes(len(batches), local_weight)
        if total_weight <= 0:
            raise BackendError("forward_backward got a batch with no trained tokens")
        per_mb: list[tuple[dict, float]] = []  # device values, read once after the passes
        n_tokens = n_slots = n_trained = 0
        idle = lambda: self._idle_pass(backward=True)  # noqa: E731
        with (contextlib.nullcontext() if dropout else model_io.dropout_off(self.model),
              self._gathered() as gathered):  # fmt: skip
            for batch in self._passes(batches, n_passes, idle, gathered):
                loss, metrics = loss_fn(self._forward_for(batch, loss_fn), batch)
                weight = weight_fn(batch)
                (loss * (weight / total_weight)).backward()
                per_mb.append(({**metrics, "loss": loss.detach()}, weight))
                n_tokens += batch.n_tokens
                n_slots += batch.n_slots
                n_trained += batch.n_trained_tokens
        sums: st.MetricSums = {}
        for metrics, weight in st.read_metrics_once(per_mb):
            st.accumulate_metrics(sums, metrics, weight)
        return {
            "metric_sums": sums,
            "n_samples": len(samples),
            "n_tokens": n_tokens,
            "n_slots": n_slots,
            "n_trained_tokens": n_trained,
            "n_microbatches": len(batches),
            "time_forward_backward_s": time.perf_counter() - t0,
        }

    def _local_optim_step(self, finish_step: bool = True) -> dict[str, float]:
        if self.optimizer is None or self.scheduler is None:
            raise BackendError("this backend's model has no trainable parameters (a reference?)")
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.optim_config.grad_clip
        max_norm = clip if clip is not None else float("inf")
        grad_norm = st.to_local_scalar(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if finish_step:
            self.scheduler.step()
            self.step += 1
            self.weight_version += 1
        return {"grad_norm": grad_norm, "lr": lr, "step": self.step}

    def _local_forward(self, samples: list[Any]) -> float:
        batches = [self._collate(mb) for mb in self.split_microbatches(samples)]
        local_weight = float(sum(self.loss_weight_fn(b) for b in batches))
        n_passes, total_weight = self._agree_passes(len(batches), local_weight)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        idle = lambda: self._idle_pass(backward=False)  # noqa: E731
        with torch.no_grad(), model_io.eval_mode(self.model), self._gathered():
            for batch in self._passes(batches, n_passes, idle):
                batch = batch.to(self.device)
                loss, _ = self.loss_fn(self._forward_for(batch, self.loss_fn), batch)
                loss_sum += loss.double() * self.loss_weight_fn(batch) / max(total_weight, 1e-12)
        return float(loss_sum)  # read once per op

    def _local_per_trained_token(self, samples: list[Any], fn,
                                 base_model: bool = False) -> list[torch.Tensor]:  # fmt: skip
        """`fn(logits, batch)` → [B, T], read at each sample's trained positions (no grad).

        Each micro-batch's trained values stay on the device (gathered at positions the host
        computes from its own copy of the batch); the op reads them back in one transfer after
        its last pass, then splits them per sample on the host: a read per micro-batch would
        drain the GPU's queue at every micro-batch boundary (issue 43).
        """
        parts: list[torch.Tensor] = []  # per micro-batch: its trained values, sample by sample
        counts: list[int] = []  # trained values per sample, in sample order
        mbs = self.split_microbatches(samples)
        n_passes, _ = self._agree_passes(len(mbs))
        idle = lambda: self._idle_pass(backward=False)  # noqa: E731
        base = lo.base_model_pass(self.model) if base_model else contextlib.nullcontext()
        with torch.no_grad(), model_io.eval_mode(self.model), base, self._gathered():
            for mb in self._passes(mbs, n_passes, idle):
                host = self._collate(mb)
                batch = host.to(self.device)
                values_BT = fn(self._forward_for(batch, fn), batch)
                index_N, mb_counts = trained_by_sample(host, len(mb))
                index_N = move_to(torch.from_numpy(index_N), values_BT.device)
                parts.append(values_BT.flatten().index_select(0, index_N).float())
                counts += mb_counts
        if not parts:
            return []
        values_N = torch.cat(parts).cpu()  # the op's one read
        return [v.clone() for v in values_N.split(counts)]  # own storage (pickled, saved)

    def _local_generate_greedy(self, prompts: list[list[int]], max_new_tokens: int,
                               batch_size: int) -> list[list[int]]:  # fmt: skip
        """Greedy decoding of this rank's prompts, in batches. Under torchrun the batch count is
        agreed first and each batch decodes with `synced_gpus` (transformers' generate then
        all-reduces "finished?" each step and a finished rank keeps making forward passes until
        every rank is done): the ranks' prompts end at different lengths."""
        chunks = [prompts[k : k + batch_size] for k in range(0, len(prompts), batch_size)]
        n_passes, _ = self._agree_passes(len(chunks))
        synced = self._dist is not None
        pad = [[self.pad_id or 0]]

        def generate(chunk: list[list[int]]) -> list[list[int]]:
            return model_io.generate_batch(self.model, self.tokenizer, chunk, max_new_tokens,
                                           synced=synced)  # fmt: skip

        out: list[list[int]] = []
        for chunk in self._passes(chunks, n_passes, lambda: generate(pad)):
            out += generate(chunk)
        return out


def trained_by_sample(host: Any, n_samples: int) -> tuple[np.ndarray, list[int]]:
    """(flat positions in [B*T] of the trained targets, grouped by sample in sample order and
    in position order within one; the count of each sample's), from a batch still on the host.

    Numpy on the host copy: no op here reads a value of the device.
    """
    flat = np.flatnonzero(host.target_ids.numpy().ravel() != IGNORE_INDEX)
    segments = host.segment_ids.numpy().ravel()[flat]
    order = np.argsort(segments, kind="stable")  # packed rows hold samples out of order
    return flat[order], np.bincount(segments, minlength=n_samples).tolist()
