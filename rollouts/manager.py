"""AsyncRolloutManager: owns rollout concurrency and turns prompts into training batches.

Contract:
- `await manager.generate_batch()` returns a RolloutBatch of `batch_size` groups ×
  `n_samples_per_prompt` samples (fewer groups only if the over-sampling cap is reached, logged;
  more samples in a group whose agent sessions branched: `Sample.sub_index`).
  Prompts come from the DataBuffer; held (partial) groups are served first.
- Generation goes through one engine or EnginePool from token ids; sampled ids and engine
  logprobs are kept as they came (never re-tokenized). A global CapacityLimiter bounds requests
  in flight across engines. Rewards run as samples finish, each under a timeout; sync rewards
  in the manager's own `RewardThreads` pool (a hung reward costs its sample only).
- The reward is `reward_fn` plus the shaping of the algorithm given to `use_algorithm`
  (`run_rl_training` calls it), and the filter follows that algorithm too unless one is given
  or configured: DAPO gets its overlong penalty and dynamic sampling wherever it is used.
- Groups failing the filter are replaced by new prompts (over-sampling); once the batch is full
  the surplus requests are aborted and the unfinished groups go back to the DataBuffer's holding
  area with their finished samples, tagged with the current weight version.
- Modes, each its own small method: "sync" (generate on demand, on-policy), "overlap" (batch
  k+1 is generated in the background while the caller trains on batch k), "async" (a producer
  keeps generating; samples more than `max_staleness` versions behind the trainer are dropped
  or regenerated, and counted — never trained on silently).
- `data_state()`: the DataBuffer's state with every prompt drawn and not yet served (a batch
  being generated or waiting) held first, for a checkpoint: a resume trains them.
- Lifecycle: `async with manager:` (or `await nursery.start(manager.run)`) ties background
  generation to a nursery the caller owns; leaving it cancels generation and, if that cut a
  batch off, aborts the engine's requests (`abort_all`). A clean exit sends nothing, so an
  engine shared with other clients keeps their requests. A collection cancelled (the manager
  left, a host's deadline on `generate_batch`) holds its prompts back: a later one serves them.

Not covered: partial rollouts that continue a cut-short *sample* (only whole samples are kept).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import trio

from plumbing.errors import RolloutsError, leaf_errors
from rollouts.config import RolloutConfig
from rollouts.generate_fn import GenerateFn, single_turn_generate
from rollouts.generation import CollectResult, GroupSource, collect_groups
from rollouts.groups import (
    GroupFilter,
    SampleTransform,
    apply_sample_transforms,
    auto_group_filter,
    convert_to_batch,
    failure_line,
    keep_all,
    keep_if_reward_varies,
)
from rollouts.prompts import PromptItem
from rollouts.request_ids import RidPrefixes
from rollouts.reward_threads import RewardThreads
from rollouts.rewards import RewardFn, RolloutAlgorithm, shape_reward
from rollouts.stall import watch_event_loop
from rollouts.types import RolloutBatch, Sample
from rollouts.unserved import UnservedGroups, held_record

log = logging.getLogger("rollouts.manager")


@dataclass(frozen=True)
class ManagerStatistics:
    batches_served: int
    batches_ready: int
    stale_groups_dropped: int
    held_groups: int


class AsyncRolloutManager:
    """See the module docstring."""

    def __init__(
        self,
        engine: Any,
        data_buffer: Any,
        config: RolloutConfig,
        *,
        reward_fn: RewardFn,
        generate_fn: GenerateFn = single_turn_generate,
        group_filter: GroupFilter | None = None,
        transforms: Sequence[SampleTransform] = (),
        current_version: Callable[[], int] = lambda: 0,
        tokenizer: Any = None,
    ):
        self.engine = engine
        self.data_buffer = data_buffer
        self.config = config
        self.task_reward = reward_fn
        self.reward_fn = reward_fn  # the task reward with the algorithm's shaping (use_algorithm)
        self.generate_fn = generate_fn
        self._own_filter = group_filter
        self.group_filter = group_filter or (
            keep_if_reward_varies if config.filter_groups == "reward_varies" else keep_all
        )
        self.transforms = tuple(transforms)
        self.current_version = current_version
        self.tokenizer = tokenizer
        self._limiter = trio.CapacityLimiter(config.max_concurrency)
        self.reward_threads = RewardThreads(config.reward_threads, max_hung=config.reward_max_hung)
        self._nursery: trio.Nursery | None = None
        self._prefetch: trio.MemoryReceiveChannel | None = None
        self._prefetched = trio.Event()  # overlap mode: the batch being prefetched is complete
        self._prefetched.set()
        self._n_calls = 0
        self._stale_dropped = 0
        self._cut_off = False  # a batch was interrupted: its requests may still run at the engine
        self._rids = RidPrefixes("b")  # a prefix per collected batch: rids unique for the run
        self._unserved = UnservedGroups()  # drawn, not yet served: checkpointed by data_state()

    def use_algorithm(self, algorithm: RolloutAlgorithm) -> None:
        """Take reward shaping and group filtering from `algorithm` for groups launched from now on.

        `run_rl_training` calls it before its first batch and whenever the algorithm changes
        (e.g. GRPO → DAPO adds overlong shaping and dynamic sampling); groups already in flight
        keep what they started with. The reward is `reward_fn` as given, plus the algorithm's
        shaping (`rollouts.rewards.shape_reward`); the filter is the `group_filter` given, else
        as `config.filter_groups` says ("auto": `rollouts.groups.auto_group_filter`).
        """
        self.reward_fn = shape_reward(algorithm, self.task_reward)
        if self._own_filter is None and self.config.filter_groups == "auto":
            self.group_filter = auto_group_filter(algorithm)

    def statistics(self) -> ManagerStatistics:
        """A snapshot: batches ready in the async producer's channel, stale groups dropped."""
        ready = 0
        if self.config.mode == "async" and self._prefetch is not None:
            ready = self._prefetch.statistics().current_buffer_used
        return ManagerStatistics(self._n_calls, ready, self._stale_dropped, self.data_buffer.n_held)

    def data_state(self) -> dict[str, Any]:
        """The DataBuffer's `state_dict()` for a checkpoint, its holding area first given every
        prompt drawn that no batch served yet (rollouts/unserved.py): a resume trains them."""
        state = self.data_buffer.state_dict()
        owed = [{"item": r, "weight_version": self.current_version()}
                for r in self._unserved.records()]  # fmt: skip
        return {**state, "held": owed + state["held"]}

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncRolloutManager:
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        if self.config.mode == "async":
            send, self._prefetch = trio.open_memory_channel[Any](1)
            self._nursery.start_soon(self._produce, send)
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        try:
            return await self._nursery_cm.__aexit__(*exc)
        finally:
            self._nursery = None
            if self._cut_off:  # finished batches abort their own surplus; others share the engine
                with trio.move_on_after(5) as scope:
                    scope.shield = True
                    await _abort_all(self.engine)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the manager's background work until cancelled (for `nursery.start`)."""
        async with self:
            task_status.started(self)
            await trio.sleep_forever()

    # -- batches --------------------------------------------------------------------------------

    async def generate_batch(self) -> RolloutBatch:
        """The next training batch, produced according to `config.mode`."""
        self._n_calls += 1
        if self.config.mode != "sync" and self._nursery is None:
            raise RuntimeError(f"mode {self.config.mode!r} needs `async with manager:` first")
        if self.config.mode == "async":
            return await self._take_fresh_enough()  # settles each collection it takes
        batch = await (self._generate_now() if self.config.mode == "sync"
                       else self._generate_overlapped())  # fmt: skip
        self._unserved.served()  # the next prefetch starts after this returns
        return batch

    async def _generate_now(self) -> RolloutBatch:
        result = await self._collect(self.config.batch_size)
        return self._to_batch(result)

    async def _generate_overlapped(self) -> RolloutBatch:
        assert self._nursery is not None
        if self._prefetch is None:
            batch = await self._generate_now()
        else:  # generated during the last step: its staleness counts from now
            try:
                batch = await self._prefetch.receive()
                batch = replace(batch, metrics={**batch.metrics, **self._staleness(batch.samples)})
            except trio.EndOfChannel:  # cancelled when the manager was left: its prompts are held
                batch = await self._generate_now()
        send, self._prefetch = trio.open_memory_channel[RolloutBatch](1)
        self._prefetched = trio.Event()
        self._nursery.start_soon(self._prefetch_one, send, self._prefetched)
        return batch

    async def _prefetch_one(self, send: trio.MemorySendChannel, done: trio.Event) -> None:
        try:
            async with send:
                await send.send(await self._generate_now())
        finally:
            done.set()

    async def settle(self) -> None:
        """Return once no batch is being generated that a weight update would cut short.

        The RL loop calls it before pausing the engines. Overlap mode: waits for the batch
        being prefetched (generated entirely by the weights it started with, one step behind);
        pausing with "abort" in the middle of it would return its samples cut short. Sync mode
        has nothing in flight; async mode keeps generating (its staleness bound applies).
        """
        if self.config.mode == "overlap":
            await self._prefetched.wait()

    async def _produce(self, send: trio.MemorySendChannel) -> None:
        async with send:
            while True:
                await send.send(await self._collect(self.config.batch_size))

    async def _take_fresh_enough(self) -> RolloutBatch:
        assert self._prefetch is not None
        groups: list[tuple[Sample, ...]] = []
        merged = CollectResult(accepted=[], partial=[])
        dropped_here = 0
        drawn: dict[int, PromptItem] = {}  # each accepted group's prompt as drawn (messages)
        while len(groups) < self.config.batch_size:
            result: CollectResult = await self._prefetch.receive()
            drawn |= self._unserved.served(result.accepted)  # each served, held or dropped below
            merged.add_counts(result)
            oldest_ok = self.current_version() - self.config.max_staleness
            for group in result.accepted:
                if min(s.weight_version for s in group) >= oldest_ok:
                    groups.append(group)
                    continue
                self._stale_dropped += 1
                dropped_here += 1
                if dropped_here > 10 * self.config.batch_size:
                    raise RolloutsError(
                        f"{dropped_here} groups in a row were more than max_staleness="
                        f"{self.config.max_staleness} versions behind the trainer (version "
                        f"{self.current_version()}, samples at {group[0].weight_version}): are "
                        "weights being pushed to the engines?"
                    )
                if self.config.stale_policy == "regenerate":
                    self._hold(drawn[id(group)], [])
        merged.accepted = groups[: self.config.batch_size]
        for group in groups[self.config.batch_size :]:
            self._hold(drawn[id(group)], list(group))
        return self._to_batch(merged)

    def _hold(self, prompt: PromptItem, samples: list[Sample]) -> None:
        self.data_buffer.hold([held_record(prompt, samples)], self.current_version())

    async def _collect(self, n_groups: int) -> CollectResult:
        cfg = self.config
        try:
            async with watch_event_loop(cfg.stall_warning_s):  # names an async reward that blocks
                result = await self._collect_groups(n_groups)
        except BaseException:  # cancelled (a host's deadline, the manager left) or failed:
            self._cut_off = True  # its prompts are served by a later collection, not forgotten
            for prompt, samples in self._unserved.abandoned():
                self._hold(prompt, samples)
            raise
        _check_failure_rate(result, cfg.max_failed_group_rate)
        line = failure_line(result.reward_errors, result.generation_errors,
                            cfg.reward_failure_value)  # fmt: skip
        if line is not None:  # one line a batch, every cause counted (any try)
            log.warning("%s", line)
        for prompt, samples in result.partial:
            self._hold(prompt, samples)
        self._unserved.collected(result.accepted)
        return result

    async def _collect_groups(self, n_groups: int) -> CollectResult:
        cfg = self.config
        return await collect_groups(
            GroupSource(self._next_prompt),
            n_groups=n_groups,
            n_samples=cfg.n_samples_per_prompt,
            engine=self.engine,
            sampling_params=cfg.sampling.params(),
            reward_fn=self.reward_fn,
            generate_fn=self.generate_fn,
            group_filter=self.group_filter,
            limiter=self._limiter,
            extra_groups=cfg.extra_groups,
            max_launches=math.ceil(cfg.max_launch_factor * n_groups) + cfg.extra_groups,
            reward_timeout_s=cfg.reward_timeout_s,
            reward_fail_fast=cfg.reward_fail_fast,
            reward_threads=self.reward_threads,
            engine_fail_fast=cfg.engine_fail_fast,
            sample_retries=cfg.sample_retries,
            reward_failure_value=cfg.reward_failure_value,
            rid_prefix=self._rids.next(),
            tokenizer=self.tokenizer,
        )

    def _next_prompt(self) -> tuple[PromptItem, list[Sample]]:
        prompt, samples = self._draw()
        self._unserved.drawn(prompt, samples)
        return prompt, samples

    def _draw(self) -> tuple[PromptItem, list[Sample]]:
        """Held groups first (dropping samples too stale to reuse), then fresh prompts."""
        if self.data_buffer.n_held:
            held = self.data_buffer.take_held(1)[0]
            prompt = PromptItem.from_dict(held.item["prompt"])
            oldest_ok = self.current_version() - self.config.max_staleness
            if self.config.mode == "sync":
                oldest_ok = self.current_version()
            samples = [Sample.from_dict(d) for d in held.item["samples"]]
            # by rollout: an agent session's branches (sub_index) are kept or redone together
            stale = {s.index_in_group for s in samples if s.weight_version < oldest_ok}
            return prompt, [s for s in samples if s.index_in_group not in stale]
        return self.data_buffer.get_prompts(1)[0], []

    def _to_batch(self, result: CollectResult) -> RolloutBatch:
        groups = [tuple(apply_sample_transforms(g, self.transforms)) for g in result.accepted]
        metrics = {
            **result.metrics(),
            **self._staleness([s for g in groups for s in g]),
            "stale_groups_dropped": float(self._stale_dropped),
            "held_groups": float(self.data_buffer.n_held),
            "reward_threads_hung": float(self.reward_threads.statistics().hung),
            **_engine_metrics(self.engine),
        }
        return convert_to_batch(groups, self.data_buffer.epoch_id, self._n_calls, metrics,
                                result.sample_errors)  # fmt: skip

    def _staleness(self, samples: Sequence[Sample]) -> dict[str, float]:
        """How many weight versions the samples are behind the trainer now."""
        version = self.current_version()
        lags = [version - s.weight_version for s in samples]
        return {
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "staleness_max": float(max(lags, default=0)),
        }


def _engine_metrics(engine: Any) -> dict[str, float]:
    """Per-engine counters of an `EnginePool` (cumulative): requests done, failures by kind,
    returns with the current weights, health now."""
    statistics = getattr(engine, "statistics", None)
    if statistics is None:
        return {}
    out: dict[str, float] = {}
    for i, e in enumerate(getattr(statistics(), "engines", ())):
        out |= {f"engine{i}/done": float(e.done), f"engine{i}/failed": float(e.failed),
                f"engine{i}/samples_sent": float(getattr(e, "samples_sent", 0)),
                f"engine{i}/samples_received": float(getattr(e, "samples_received", 0)),
                f"engine{i}/rejoined": float(e.rejoined), f"engine{i}/healthy": float(e.healthy)}  # fmt: skip
        out |= {f"engine{i}/failed/{kind}": float(n) for kind, n in e.failures.items()}
    return out


def _check_failure_rate(result: CollectResult, max_rate: float) -> None:
    """Groups dropped after an engine error are counted; past `max_rate` of those launched the
    run ends, naming which engines failed how."""
    failed = sum(result.failures.values())
    if not failed or failed <= max_rate * result.n_launched:
        return
    how = ", ".join(f"{what} x{n}" for what, n in result.failures.most_common())
    raise RolloutsError(
        f"{failed} of {result.n_launched} groups failed on engines in one batch, more than "
        f"rollout.max_failed_group_rate={max_rate}: {how}"
    )


async def _abort_all(engine: Any) -> None:
    abort_all = getattr(engine, "abort_all", None)
    if abort_all is None:
        return
    try:
        await abort_all()
    except Exception as err:  # shutting down: report, never mask the original exit reason
        causes = "; ".join(f"{type(e).__name__}: {e}" for e in leaf_errors(err))
        log.warning("abort_all on shutdown failed: %s", causes)
