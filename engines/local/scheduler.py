"""Continuous batching for the local engine: the trio side of the model loop.

Contract:
- One trio task (`run`) owns the waiting queue and the running batch. Each iteration it
  admits waiting sequences (up to `max_running_requests` and a prefill token budget), then
  runs ONE model step (decode every running row + prefill the admitted ones) on a single worker
  thread, then applies the results: append tokens, check stop conditions, wake waiters. So a
  new request joins at the next step instead of waiting for the batch to drain.
- All mutation of sequences happens here, on the trio thread, between steps.
- Abort is immediate for the caller (the sequence finishes with `finish_reason.type ==
  "abort"`; "Abort in waiting queue" if it had not started); its row is dropped at the next step.
- Exact-logprobs mode (`exact`, exact_logprobs.py): the requests a step finishes are rescored
  on the model thread before anyone hears of them, inside the step (no weight update between).
- LoRA (lora_registry.py): a sequence joins the batch only if the distinct adapters running
  (the base model counts as one) stay within `max_loras_per_batch`, else it waits, as in
  SGLang; `submit` counts the requests using each adapter, and an unload waits for them.

Pause, cache flush and weight updates (their contract too): scheduler_control.py.

Not covered: priorities, preemption under memory pressure.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import trio

from .exact_logprobs import wants_rescoring
from .memory_occupation import MemoryOccupation
from .params import GenerateItem
from .sampling_params import BadRequestError
from .scheduler_control import PauseMode as PauseMode
from .scheduler_control import ReadWriteLock, SchedulerControl
from .sequence import Sequence

logger = logging.getLogger(__name__)


def abort_reason(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


class Scheduler(SchedulerControl):
    def __init__(
        self,
        runner: Any,
        decode: Callable[[list[int], bool], str],
        *,
        model_path: str,
        weight_version: str,
        max_running_requests: int = 128,
        max_prefill_tokens: int = 8192,
        max_loras_per_batch: int = 8,
        exact: Callable[[list[Sequence]], list[list[float] | str]] | None = None,
    ) -> None:
        self.runner = runner
        self.memory = MemoryOccupation(runner)  # /release_memory_occupation (colocated mode)
        self.exact = exact  # rescores finished sequences on the model thread (exact_logprobs.py)
        self._decode = decode  # (token ids, skip_special_tokens) -> text
        self.model_path = model_path
        self.weight_version = weight_version
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused = False
        self._resumed = trio.Event()
        self.held: list[Sequence] = []  # arrived during a pause, not queued yet
        self._wakeup = trio.Event()
        self._limiter = trio.CapacityLimiter(1)  # the single model thread
        self._step_done = trio.Event()
        self._stepping = False
        self._update_lock = ReadWriteLock()
        self.generated_tokens = 0
        self.last_gen_throughput = 0.0
        # LoRA: the registry (set by the server when --enable-lora), distinct adapters per
        # running batch (SGLang counts the base model as one), requests using each adapter
        self.lora: Any = None
        self.max_loras_per_batch = max_loras_per_batch
        self.lora_in_use: Counter[str] = Counter()
        self._lora_released = trio.Event()

    # ----- the loop -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            while self.paused or not (self.waiting or self.running):
                self._wakeup = trio.Event()
                await self._wakeup.wait()
            self.running = [s for s in self.running if not s.finished]
            admit = self._admit()
            if not self.running and not admit:
                continue
            keep = list(self.running)
            self.running += admit
            self._stepping, self._step_done = True, trio.Event()
            started = time.perf_counter()
            try:
                out = await trio.to_thread.run_sync(
                    self.runner.step, keep, admit, limiter=self._limiter
                )
                touched = self._apply(out, time.perf_counter() - started)
                if self.exact is not None:
                    await self._rescore([s for s in touched if wants_rescoring(s)])
                for seq in touched:
                    notify(seq)
            except Exception as exc:  # a bug or a broken model: fail this batch, keep serving
                logger.exception("model step failed; failing %d requests", len(self.running))
                for seq in self.running:
                    if not seq.finished:
                        seq.error = f"Internal error in the model step: {exc!r}"
                        notify(seq)
                self.running = []
                await trio.to_thread.run_sync(self.runner.reset, limiter=self._limiter)
            finally:
                self._stepping = False
                self._step_done.set()

    def _admit(self) -> list[Sequence]:
        """Waiting sequences in order, within the request, prefill-token and adapter bounds; a
        sequence whose adapter would exceed `max_loras_per_batch` waits (SGLang skips it too)."""
        admit: list[Sequence] = []
        deferred: list[Sequence] = []
        adapters = {s.item.lora_name for s in self.running}
        longest = 0
        while self.waiting and len(self.running) + len(admit) < self.max_running_requests:
            seq = self.waiting[0]
            if seq.finished:
                self.waiting.popleft()
                continue
            lora = seq.item.lora_name
            if lora not in adapters and len(adapters) >= self.max_loras_per_batch:
                deferred.append(self.waiting.popleft())
                continue
            longest = max(longest, len(seq.prefill_ids))
            if admit and longest * (len(admit) + 1) > self.max_prefill_tokens:
                break
            adapters.add(lora)
            admit.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(deferred))
        return admit

    async def _rescore(self, seqs: list[Sequence]) -> None:
        """Replace the finished `seqs`' output logprobs by the exact ones (model thread)."""
        if not seqs:
            return
        try:
            results = await trio.to_thread.run_sync(self.exact, seqs, limiter=self._limiter)
        except Exception as exc:  # they fail rather than return logprobs of another kind
            logger.exception("exact logprob scoring failed for %d requests", len(seqs))
            results = [f"Exact logprob scoring failed: {exc!r}"] * len(seqs)
        for seq, result in zip(seqs, results, strict=True):
            if isinstance(result, str):
                seq.error = result
            else:
                seq.output_logprobs[:] = result

    def _apply(self, out: Any, elapsed: float) -> set[Sequence]:
        """The step's results on the sequences; the ones changed (to notify)."""
        touched: set[Sequence] = set()
        for p in out.prefilled:
            seq = p.seq
            if seq.finished:
                continue
            if not seq.prefilled:
                seq.input_logprobs, seq.input_top = p.input_logprobs, p.input_top
                seq.cached_tokens = p.cached_tokens
                seq.prefilled = True
            if seq.item.params.max_new_tokens == 0:
                seq.finish_reason = {"type": "length", "length": 0}
            touched.add(seq)
        for seq, token, logprob, top in out.tokens:
            if seq.finished:
                continue
            seq.append(token, logprob, top, self.weight_version)
            self._check_finished(seq)
            touched.add(seq)
        for seq, message in out.errors:
            if not seq.finished:
                seq.error = message
                touched.add(seq)
        self.generated_tokens += len(out.tokens)
        if elapsed > 0 and out.tokens:
            self.last_gen_throughput = len(out.tokens) / elapsed
        return touched

    def _check_finished(self, seq: Sequence) -> None:
        params = seq.item.params
        if len(seq.output_ids) >= params.max_new_tokens:
            seq.finish_reason = {"type": "length", "length": params.max_new_tokens}
            return
        last = seq.output_ids[-1]
        if not params.ignore_eos and (last in self.runner.eos_ids or last in params.stop_token_ids):
            seq.finish_reason = {"type": "stop", "matched": last}
            return
        if params.stop:
            seq.text = self._decode(seq.output_ids, params.skip_special_tokens)
            for stop in params.stop:
                if stop in seq.text:
                    seq.finish_reason = {"type": "stop", "matched": stop}
                    return

    def _wake(self) -> None:
        self._wakeup.set()

    # ----- requests -------------------------------------------------------------------------

    @asynccontextmanager
    async def submit(self, items: Iterable[GenerateItem], *, lock: bool = True):
        """Queue the items; yield their sequences. Unfinished ones are aborted on exit.

        LoRA adapter names are resolved once a pause is over (SGLang's tokenizer manager waits
        for the pause before `_validate_and_resolve_lora`), so a request sent during a weight
        sync may name the adapter the sync is loading.

        Raises:
            BadRequestError: a named adapter is unknown or cannot be loaded again.
        """
        async with self._update_lock.read() if lock else _null():
            seqs = [Sequence(item) for item in items]
            await self._hold(seqs)  # a push's pause: the weights it loads are there after it
            self.memory.check_serving()
            adapters = [s.item.lora_name for s in seqs if s.item.lora_name is not None]
            if adapters:
                if self.lora is None:
                    raise BadRequestError("LoRA adapters are not enabled on this server.")
                await self.lora.resolve(adapters)
                self.lora.check_loaded(adapters)
                # again: a release may have found the engine idle while an evicted adapter was
                # reloaded (the model thread), and these would then run on released weights;
                # from here to their queueing nothing awaits, so a release sees them busy
                self.memory.check_serving()
            self.lora_in_use.update(adapters)
            try:
                self.waiting.extend(s for s in seqs if not s.finished)
                self._wake()
                try:
                    yield seqs
                finally:
                    self.abort_sequences([s for s in seqs if not s.finished])
            finally:
                self.lora_in_use.subtract(adapters)
                if adapters:
                    self._lora_released.set()
                    self._lora_released = trio.Event()

    async def _hold(self, seqs: list[Sequence]) -> None:
        """While paused: wait in front of the scheduler (abortable by rid)."""
        if not self.paused:
            return
        self.held += seqs
        try:
            while self.paused and not all(s.finished for s in seqs):
                await _wait_any(self._resumed, seqs)
        finally:
            self.held = [s for s in self.held if s not in seqs]

    async def wait_lora_unused(self, name: str) -> None:
        """Until no request uses adapter `name` (SGLang waits the same way before unloading)."""
        while self.lora_in_use[name] > 0:
            await self._lora_released.wait()
        del self.lora_in_use[name]

    async def run_on_model_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the model thread, between two steps (adapter loads and deletes)."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def abort_sequences(self, seqs: Iterable[Sequence]) -> int:
        count = 0
        for seq in seqs:
            if seq.finished:
                continue
            started = seq.prefilled or seq in self.running
            seq.finish_reason = abort_reason("Aborted" if started else "Abort in waiting queue")
            notify(seq)
            count += 1
        return count

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Abort `rid` and, as SGLang 0.5.23's scheduler does, every rid it is a prefix of.

        Requests held behind a pause are not reached (SGLang's tokenizer manager has not
        registered them yet, nor has the scheduler): they run after the resume."""
        if not abort_all and not rid:
            return 0
        live = [*self.waiting, *self.running]
        return self.abort_sequences(s for s in live if abort_all or s.rid.startswith(rid or ""))


def notify(seq: Sequence) -> None:
    """Wake everyone waiting on `seq.changed`."""
    event, seq.changed = seq.changed, trio.Event()
    event.set()


async def _wait_any(event: trio.Event, seqs: list[Sequence]) -> None:
    """Until `event` is set or one of `seqs` changes (e.g. it is aborted)."""
    async with trio.open_nursery() as nursery:

        async def wait(e: trio.Event) -> None:
            await e.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(wait, event)
        for seq in seqs:
            nursery.start_soon(wait, seq.changed)


@asynccontextmanager
async def _null() -> AsyncIterator[None]:
    yield
