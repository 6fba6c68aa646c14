"""WorkerRolloutManager: `AsyncRolloutManager`'s interface over K rollout worker processes.

Contract (sync mode; `rollout.workers: K` > 0):
- `async with manager:` starts K workers (rollouts/workers/worker.py) in the manager's nursery,
  worker k with an `EnginePool` over engines `k::K` of `engine_urls`; leaving it ends them.
- `await manager.generate_batch()` returns a RolloutBatch of `batch_size` groups, as
  `AsyncRolloutManager` does in sync mode: the trainer draws prompts from the DataBuffer (held
  groups first, their samples kept only when made by the current weights), sends them to the
  workers round-robin, and the workers generate and score every group (the reward named by
  `module:function`, imported by each worker, plus the algorithm's overlong shaping). The trainer
  filters the groups (`group_filter`; DAPO's dynamic sampling), draws replacement prompts for the
  rejected or failed ones up to the over-sampling cap, and holds surplus and cut-short groups in
  the DataBuffer. Groups come back in the order their prompts were drawn.
- Exactly once: a worker's groups count only when its whole answer arrived. A worker that dies
  (killed, crashed, a truncated frame) or gives no answer within `rollout.worker_timeout_s` is
  killed, restarted, and sent the same prompts again (new request ids), up to
  `rollout.worker_restarts` times per batch; its lost answer is never read, so nothing is
  trained twice and nothing lost (`workers/restarts` in the batch metrics counts them). The
  new worker first aborts the requests the lost one left on its engines (by rid prefix): an
  engine behind a proxy or router never sees the dead worker's connections close.
- `data_state()`, `use_algorithm()`, `settle()` and `statistics()` as in `AsyncRolloutManager`.
  The weight push goes from the trainer to every engine as before: the workers' pools see the
  engines paused, and sync mode has nothing in flight then. The trainer's pool alone gives an
  engine back from a relaunch its weights; each request names the version of the trainer's
  last push (`engine_weights()`), and a worker's pool (`follows_weights`) uses no engine that
  serves older ones (engines/pool_membership.py), so no sample comes from initial weights.

Not covered yet: overlap and async modes (refused by `RolloutConfig`), a `generate_fn` other
than the single turn, a reward given as a Python object (a worker imports it by name).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import trio

from plumbing.errors import RolloutsError, leaf_errors
from rollouts.config import RolloutConfig
from rollouts.generation import CollectResult
from rollouts.groups import (
    Group,
    GroupFilter,
    SampleTransform,
    apply_sample_transforms,
    convert_to_batch,
    failure_line,
    keep_all,
    keep_if_reward_varies,
)
from rollouts.manager import ManagerStatistics, _accumulate, _check_failure_rate
from rollouts.prompts import PromptItem
from rollouts.request_ids import RidPrefixes
from rollouts.rewards import RolloutAlgorithm
from rollouts.types import RolloutBatch, Sample
from rollouts.unserved import UnservedGroups, held_record, prompt_of
from rollouts.workers.frames import decode_groups
from rollouts.workers.process import WorkerLost, WorkerProcess
from rollouts.workers.worker import stats_result

log = logging.getLogger("rollouts.workers")

Draw = tuple[int, PromptItem, list[Sample]]  # (draw order in the batch, prompt, held samples)


class WorkerRolloutManager:
    """See the module docstring."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        data_buffer: Any,
        config: RolloutConfig,
        *,
        reward: str,
        group_filter: GroupFilter | None = None,
        transforms: Sequence[SampleTransform] = (),
        current_version: Callable[[], int] = lambda: 0,
        engine_weights: Callable[[], str | None] = lambda: None,
        api_key: str | None = None,
    ):
        k = config.workers
        if k < 1:
            raise ValueError("WorkerRolloutManager needs rollout.workers >= 1 (0: use "
                             "AsyncRolloutManager, generation in this process)")  # fmt: skip
        if len(engine_urls) < k:
            raise RolloutsError(f"rollout.workers={k} needs at least {k} engine URLs (one "
                                f"slice each), got {len(engine_urls)}: {list(engine_urls)}")  # fmt: skip
        self.data_buffer = data_buffer
        self.config = config
        self.reward = reward
        self._own_filter = group_filter
        self.group_filter = group_filter or (
            keep_if_reward_varies if config.filter_groups == "reward_varies" else keep_all
        )
        self.transforms = tuple(transforms)
        self.current_version = current_version
        self.engine_weights = engine_weights  # the version of the trainer's last push, or None
        per_worker = config.model_copy(
            update={"max_concurrency": math.ceil(config.max_concurrency / k), "workers": 0}
        )
        self.workers = [WorkerProcess(i, list(engine_urls[i::k]), per_worker, reward,
                                      timeout_s=config.worker_timeout_s, api_key=api_key)
                        for i in range(k)]  # fmt: skip
        self.restarts = 0
        self._overlong: dict[str, Any] | None = None
        self._nursery: trio.Nursery | None = None
        self._n_calls = 0
        self._rids = RidPrefixes("b")
        self._unserved = UnservedGroups()

    def use_algorithm(self, algorithm: RolloutAlgorithm) -> None:
        """As `AsyncRolloutManager.use_algorithm`: the workers apply its overlong shaping."""
        o = algorithm.overlong
        self._overlong = None if o is None else {
            "max_response_len": o.max_response_len, "cache_len": o.cache_len,
            "penalty_factor": o.penalty_factor}  # fmt: skip
        if self._own_filter is None and self.config.filter_groups == "auto":
            self.group_filter = keep_if_reward_varies if algorithm.filter_zero_std else keep_all

    def statistics(self) -> ManagerStatistics:
        return ManagerStatistics(self._n_calls, 0, 0, self.data_buffer.n_held)

    def data_state(self) -> dict[str, Any]:
        """As `AsyncRolloutManager.data_state`: prompts drawn and not yet served held first."""
        state = self.data_buffer.state_dict()
        owed = [{"item": r, "weight_version": self.current_version()}
                for r in self._unserved.records()]  # fmt: skip
        return {**state, "held": owed + state["held"]}

    async def settle(self) -> None:
        """Sync mode: nothing is in flight between batches."""

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> WorkerRolloutManager:
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        try:
            async with trio.open_nursery() as starting:
                for worker in self.workers:
                    starting.start_soon(worker.start, self._nursery)
        except BaseException as exc:
            self._nursery.cancel_scope.cancel()
            await self._nursery_cm.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()  # ends the worker processes
        try:
            return await self._nursery_cm.__aexit__(*exc)
        finally:
            self._nursery = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with self:
            task_status.started(self)
            await trio.sleep_forever()

    # -- batches --------------------------------------------------------------------------------

    async def generate_batch(self) -> RolloutBatch:
        if self._nursery is None:
            raise RuntimeError("WorkerRolloutManager needs `async with manager:` first (its "
                               "worker processes live in its nursery)")  # fmt: skip
        self._n_calls += 1
        result, groups = await self._collect()
        batch = self._to_batch(result, groups)
        self._unserved.served()
        return batch

    async def _collect(self) -> tuple[CollectResult, list[Group]]:
        cfg = self.config
        n = cfg.batch_size
        cap = math.ceil(cfg.max_launch_factor * n) + cfg.extra_groups
        total = CollectResult(accepted=[], partial=[])
        accepted: list[tuple[int, Group]] = []
        want, drawn = n + cfg.extra_groups, 0
        while len(accepted) < n and total.n_launched < cap:
            draws = [(drawn + i, *self._next_prompt()) for i in range(min(want, cap - drawn))]
            drawn += len(draws)
            for part, groups, partial in await self._fan_out(draws):
                _accumulate(total, part)
                total.partial += partial
                for order, group in groups:
                    if self.group_filter(group):
                        accepted.append((order, group))
                    else:  # counted like the in-process manager's: tokens of kept groups only
                        total.n_filtered += 1
                        total.completion_tokens -= sum(len(s.response_ids) for s in group)
            want = n - len(accepted)
        _check_failure_rate(total, cfg.max_failed_group_rate)
        line = failure_line(total.reward_errors, total.generation_errors,
                            cfg.reward_failure_value)  # fmt: skip
        if line is not None:
            log.warning("%s", line)
        accepted.sort(key=lambda og: og[0])
        kept = [g for _, g in accepted[:n]]
        version = self.current_version()
        surplus = [(prompt_of(g), list(g)) for _, g in accepted[n:]]
        for prompt, samples in total.partial + surplus:
            self.data_buffer.hold([held_record(prompt, samples)], version)
        total.accepted = kept
        self._unserved.collected(kept)
        return total, kept

    async def _fan_out(self, draws: list[Draw]
                       ) -> list[tuple[CollectResult, list[tuple[int, Group]], list]]:  # fmt: skip
        """Each worker's answer for its share of `draws` (round-robin), asked concurrently."""
        k = len(self.workers)
        answers: list[Any] = [None] * k
        prefix = self._rids.next()

        async def ask(i: int) -> None:
            answers[i] = await self._ask(self.workers[i], draws[i::k], prefix)

        try:
            async with trio.open_nursery() as nursery:
                for i in range(min(k, len(draws))):
                    nursery.start_soon(ask, i)
        except BaseExceptionGroup as group:  # a worker's error, as itself: it names the cause
            leaves = leaf_errors(group)
            if all(isinstance(e, RolloutsError) for e in leaves):
                raise leaves[0] from group
            raise
        return [a for a in answers if a is not None]

    async def _ask(self, worker: WorkerProcess, draws: list[Draw], prefix: str
                   ) -> tuple[CollectResult, list[tuple[int, Group]], list]:  # fmt: skip
        assert self._nursery is not None
        prompts = [{"prompt": p.to_dict(), "samples": [s.to_dict() for s in done]}
                   for _, p, done in draws]  # fmt: skip
        left_running: list[str] = []  # rid prefixes of the lost workers' requests
        for attempt in range(self.config.worker_restarts + 1):
            try:
                if attempt:
                    await worker.restart(self._nursery)
                rid_prefix = f"{prefix}-w{worker.index}-t{worker.starts}"  # new rids per start
                header, buffers = await worker.ask({
                    "kind": "collect", "request": self._n_calls, "prompts": prompts,
                    "rid_prefix": rid_prefix, "overlong": self._overlong,
                    "engine_weights": self.engine_weights(), "abort": left_running})  # fmt: skip
                break
            except WorkerLost as err:
                # its requests may still run: an engine behind a proxy or router does not see
                # the worker's connections close; the next worker aborts them first
                left_running.append(f"{rid_prefix}-")
                if attempt == self.config.worker_restarts:
                    raise RolloutsError(
                        f"{err}; it was lost {attempt + 1} times in one batch, more than "
                        f"rollout.worker_restarts={self.config.worker_restarts}"
                    ) from err
                self.restarts += 1
                log.warning("%s: restarting it; its %d groups are generated again", err,
                            len(draws))  # fmt: skip
        groups = decode_groups(header["groups"], buffers)
        ordered = [(draws[slot][0], g) for slot, g in zip(header["slots"], groups, strict=True)]
        partial = [(draws[p["slot"]][1], [Sample.from_dict(s) for s in p["samples"]])
                   for p in header["partial"]]  # fmt: skip
        return stats_result(header["stats"]), ordered, partial

    def _next_prompt(self) -> tuple[PromptItem, list[Sample]]:
        """Held groups first (keeping only samples of the current weights), then fresh ones."""
        if self.data_buffer.n_held:
            held = self.data_buffer.take_held(1)[0]
            prompt = PromptItem.from_dict(held.item["prompt"])
            samples = [Sample.from_dict(d) for d in held.item["samples"]]
            stale = {s.index_in_group for s in samples
                     if s.weight_version < self.current_version()}  # fmt: skip
            samples = [s for s in samples if s.index_in_group not in stale]
        else:
            prompt, samples = self.data_buffer.get_prompts(1)[0], []
        self._unserved.drawn(prompt, samples)
        return prompt, samples

    def _to_batch(self, result: CollectResult, groups: list[Group]) -> RolloutBatch:
        groups = [tuple(apply_sample_transforms(g, self.transforms)) for g in groups]
        version = self.current_version()
        lags = [version - s.weight_version for g in groups for s in g]
        metrics = {
            **result.metrics(),
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "staleness_max": float(max(lags, default=0)),
            "held_groups": float(self.data_buffer.n_held),
            "workers/restarts": float(self.restarts),
        }
        return convert_to_batch(groups, self.data_buffer.epoch_id, self._n_calls, metrics,
                                result.sample_errors)  # fmt: skip
