"""Rollout generation: a batch of groups with filtering and refill (`collect_groups`).

`collect_groups` is the engine of every rollout mode: it runs one task per prompt group under a
global concurrency limit, scores samples as they finish, keeps groups that pass the filter
(default: reward std > 0, DAPO's dynamic sampling), launches replacement prompts for rejected
ones (over-sampling) until `n_groups` are accepted, then aborts the surplus requests. Groups
cut short are handed back (prompt + finished samples) so the caller can return them to the
DataBuffer's holding area. One group's generation (the `GenerateFn` contract, the default
single turn) is in `generate_fn.py`; the pure parts (filters, transforms, conversion to a
`RolloutBatch`, metrics) in `groups.py`. Their names stay importable from here.

A failed sample (an engine error the EnginePool could not fail over, a failed generation, a
reward's `DropSample`) is generated again, alone, up to `sample_retries` times; only then is its
group dropped and counted. A 4xx is not retried (it would fail again). A reward that raises,
times out or returns no number fails its sample the same way (it is never trained on a made-up
reward), unless `reward_failure_value` is set: then the sample gets that value, the error kept
on it. Every reward failure is counted by cause (`reward_errors`), every try included.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import trio

from plumbing.errors import EngineError, RolloutsError, describe_engine_failure, leaf_errors
from rollouts.coalesce import CoalescingEngine
from rollouts.generate_fn import GenerateContext as GenerateContext
from rollouts.generate_fn import GenerateEngine as GenerateEngine
from rollouts.generate_fn import GenerateFn as GenerateFn
from rollouts.generate_fn import hold_slots as hold_slots
from rollouts.generate_fn import single_turn_generate as single_turn_generate
from rollouts.groups import Group as Group
from rollouts.groups import GroupFilter as GroupFilter
from rollouts.groups import SampleTransform as SampleTransform
from rollouts.groups import apply_sample_transforms as apply_sample_transforms
from rollouts.groups import convert_to_batch as convert_to_batch
from rollouts.groups import keep_all as keep_all
from rollouts.groups import keep_if_reward_varies as keep_if_reward_varies
from rollouts.groups import rollout_metrics as rollout_metrics
from rollouts.groups import summarize_errors as summarize_errors
from rollouts.prompts import PromptItem
from rollouts.reward_threads import RewardThreads
from rollouts.rewards import RewardFn
from rollouts.scoring import reward_failure, score_samples
from rollouts.types import Sample

log = logging.getLogger("rollouts.generation")


@dataclass
class CollectResult:
    """Outcome of one `collect_groups` call."""

    accepted: list[Group]
    partial: list[tuple[PromptItem, list[Sample]]]  # cut short: prompt + finished samples
    n_launched: int = 0
    n_filtered: int = 0
    n_failed_groups: int = 0
    n_failed_samples: int = 0
    n_retried_samples: int = 0  # failed samples generated again (rollout.sample_retries)
    n_reward_failed: int = 0  # reward calls that failed (raised, timed out, no number), any try
    n_interrupted: int = 0  # groups with samples aborted by someone else, held for later
    completion_tokens: int = 0
    reward_sum: float = 0.0  # over every scored sample, accepted or filtered out
    n_scored: int = 0
    wall_time_s: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)  # "url: kind" of dropped groups
    sample_errors: Counter[str] = field(default_factory=Counter)  # error text of failed samples
    reward_errors: Counter[str] = field(default_factory=Counter)  # each failed reward call's error
    generation_errors: Counter[str] = field(default_factory=Counter)  # other failed samples'

    def metrics(self) -> dict[str, float]:
        # With a group filter (DAPO's dynamic sampling) `reward_mean` is the kept groups' mean;
        # this is the policy's: every group generated and scored, kept or not.
        scored = {"reward_mean_generated": self.reward_sum / self.n_scored} if self.n_scored else {}
        return {
            **scored,
            "groups_launched": float(self.n_launched),
            "groups_filtered": float(self.n_filtered),
            "groups_failed": float(self.n_failed_groups),
            "samples_failed": float(self.n_failed_samples),
            "samples_retried": float(self.n_retried_samples),
            "reward_failed": float(self.n_reward_failed),
            "groups_interrupted": float(self.n_interrupted),
            "groups_returned_partial": float(len(self.partial)),
            "generate_time_s": self.wall_time_s,
            "rollout_tokens_per_s": self.completion_tokens / max(self.wall_time_s, 1e-9),
        }

    def add_counts(self, part: CollectResult) -> None:
        """Add `part`'s counts and errors to these (not its groups: the caller sorts those)."""
        for f in fields(self):
            if f.name not in ("accepted", "partial"):
                mine = getattr(self, f.name)
                if isinstance(mine, Counter):
                    mine.update(getattr(part, f.name))
                else:
                    setattr(self, f.name, mine + getattr(part, f.name))


@dataclass(frozen=True)
class GroupSource:
    """Where groups come from: held (partial) groups first, then fresh prompts."""

    next_prompt: Callable[[], tuple[PromptItem, list[Sample]]]


async def collect_groups(
    source: GroupSource,
    *,
    n_groups: int,
    n_samples: int,
    engine: GenerateEngine,
    sampling_params: Mapping[str, Any],
    reward_fn: RewardFn,
    generate_fn: GenerateFn = single_turn_generate,
    group_filter: GroupFilter = keep_if_reward_varies,
    limiter: trio.CapacityLimiter,
    extra_groups: int = 0,
    max_launches: int | None = None,
    reward_timeout_s: float = 30.0,
    reward_fail_fast: bool = False,
    reward_threads: RewardThreads | None = None,
    engine_fail_fast: bool = False,
    sample_retries: int = 0,
    reward_failure_value: float | None = None,
    rid_prefix: str = "r",
    tokenizer: Any = None,
    warn_at_cap: bool = True,
) -> CollectResult:
    """Generate and score groups until `n_groups` pass `group_filter`; abort the surplus.

    Args:
        source: yields (prompt, already finished samples) — partial groups resume here.
        extra_groups: groups launched beyond `n_groups` up front to hide filtering latency.
        max_launches: cap on groups launched in total (default 4 × n_groups + extra); when it is
            reached and nothing is in flight, fewer than `n_groups` groups are returned.
        reward_threads: the pool sync rewards run in (default: one for this call).
        engine_fail_fast: an engine error raises instead of dropping the group (counted in
            `n_failed_groups` and `failures`).
        sample_retries: times a group's failed samples (a transient engine error, a failed
            generation, a reward's `DropSample`) are generated again before the group is dropped.
        reward_failure_value: the reward of a sample whose reward raised or timed out (error kept
            on the sample); None: the sample fails like the others. Counted in `reward_failed`
            either way.
        warn_at_cap: log (a WARNING once a process) when `max_launches` ends the call short of
            `n_groups`; False where the caller replaces the missing groups itself (a rollout
            worker: the trainer draws more prompts), so the batch is not smaller.

    Raises:
        EngineError: an engine request failed and `engine_fail_fast` is set.
        RewardError: a reward raised or timed out and `reward_fail_fast` is set.
    """
    started = time.perf_counter()
    cap = max_launches if max_launches is not None else 4 * n_groups + extra_groups
    result = CollectResult(accepted=[], partial=[])
    send, recv = trio.open_memory_channel[tuple[int, str, PromptItem, list[Sample]]](math.inf)
    # launched, not reported yet: (prompt, its samples, the context of its request in flight)
    running: dict[int, tuple[PromptItem, list[Sample], GenerateContext | None]] = {}
    slot_lock = trio.Lock()
    threads = reward_threads or RewardThreads()

    async def run_group(gid: int, prompt: PromptItem, done: list[Sample]) -> None:
        outcome, error = "done", None
        for attempt in range(sample_retries + 1):
            # A sample that failed (a transient engine error, a failed generation, a reward's
            # DropSample) is generated again; the failed attempt is never kept (exactly once).
            missing = _missing_indices(done, n_samples)
            if not missing:
                error = None
                break
            if attempt:
                result.n_retried_samples += len(missing)
                log.info("group %d: generating %d failed samples again (retry %d of %d)",
                         gid, len(missing), attempt, sample_retries)  # fmt: skip
            try:
                await generate_samples(gid, attempt, prompt, done, missing)
                error = None
            except* EngineError as group:  # except*: it arrives wrapped by the nurseries
                if engine_fail_fast:
                    raise
                # a generate function's own nurseries (an agent's sessions) nest the groups
                error = leaf_errors(group)[0]
            if error is not None and not _transient(error):
                break  # a 4xx fails again: drop the group now
        if error is not None:
            log.warning("group %d dropped after an engine error: %s", gid, error)
            result.failures[describe_engine_failure(error)] += 1
            outcome = "failed"
        running.pop(gid, None)  # before the send: a group reported is never also cut off
        await send.send((gid, outcome, prompt, done))

    async def generate_samples(gid: int, attempt: int, prompt: PromptItem, done: list[Sample],
                               missing: list[int]) -> None:  # fmt: skip
        """Generate and score the samples at `missing` (indices in the group) into `done`."""
        done[:] = [s for s in done if s.index_in_group not in missing]  # a rollout is redone whole
        reported: set[tuple[int, int]] = set()  # (index_in_group, sub_index)
        to_score: list[Sample] = []  # reported, not yet handed to a scoring task

        async def score_reported() -> None:
            batch = to_score[:]
            to_score.clear()
            scored = await score_samples(reward_fn, batch, timeout_s=reward_timeout_s,
                                         fail_fast=reward_fail_fast, threads=threads,
                                         failure_reward=reward_failure_value)  # fmt: skip
            for before, after in zip(batch, scored, strict=True):
                if (error := reward_failure(before, after)) is not None:
                    result.n_reward_failed += 1
                    result.reward_errors[error] += 1
                elif after.status == "failed":  # at generation, or its reward's DropSample
                    failed = before if before.status == "failed" else after
                    result.generation_errors[failed.error or "failed"] += 1
            done.extend(scored)

        try:
            async with trio.open_nursery() as scoring:

                def report(sample: Sample) -> None:
                    # Samples reported together (no await in between, e.g. the results of one
                    # batched request) are scored together: one scoring task, one thread call.
                    sample = replace(sample, index_in_group=missing[sample.index_in_group])
                    key = (sample.index_in_group, sample.sub_index)
                    if key in reported:
                        return
                    reported.add(key)
                    if not to_score:
                        scoring.start_soon(score_reported)
                    to_score.append(sample)

                suffix = f"-a{attempt}" if attempt else ""
                ctx = GenerateContext(ctx_engine, sampling_params, limiter,
                                      f"{rid_prefix}-g{gid}{suffix}", gid, tokenizer,
                                      report=report, slot_lock=slot_lock)  # fmt: skip
                running[gid] = (prompt, done, ctx)
                for sample in await generate_fn(prompt, len(missing), ctx):
                    report(sample)
        finally:
            running[gid] = (prompt, done, None)  # no request in flight

    async with trio.open_nursery() as nursery:
        ctx_engine = (CoalescingEngine(engine, nursery)  # concurrent groups: one request
                      if hasattr(engine, "generate_batch") else engine)  # fmt: skip

        def launch() -> None:
            prompt, held = source.next_prompt()
            gid, done = result.n_launched, list(held)
            running[gid] = (prompt, done, None)  # cut off with the others if not started yet
            nursery.start_soon(run_group, gid, prompt, done)
            result.n_launched += 1

        for _ in range(min(cap, n_groups + extra_groups)):
            launch()
        n_received = 0  # groups whose outcome came back
        while len(result.accepted) < n_groups:
            if n_received == result.n_launched and result.n_launched >= cap:
                if warn_at_cap:
                    _log_cap_reached(cap, len(result.accepted), n_groups)
                break
            _, kind, prompt, samples = await recv.receive()
            n_received += 1
            group = tuple(sorted(samples, key=lambda s: (s.index_in_group, s.sub_index)))
            if kind == "done" and any(s.status == "aborted" for s in group):
                # Cut short by someone else (a pause with "abort", an abort_all): not a real
                # outcome. Keep the finished samples for later, as for surplus groups.
                result.partial.append((prompt, _finished(group)))
                result.n_interrupted += 1
                if result.n_launched < cap:
                    launch()
                continue
            n_failed = sum(s.status == "failed" for s in group)
            n_reward_failed = sum(s.status != "failed" and s.error is not None for s in group)
            result.n_failed_samples += n_failed
            result.sample_errors.update(s.error or "failed" for s in group
                                        if s.status == "failed" or s.error is not None)  # fmt: skip
            # A group whose every reward failed carries no signal (all failure values): it fails
            # like a failed group, so a reward that is broken for good empties the batches and
            # ends the run naming its error (train.max_empty_batches) instead of training on 0s.
            no_signal = n_reward_failed == len(group)
            if kind == "failed" or n_failed or no_signal or _n_rollouts(group) < n_samples:
                result.n_failed_groups += 1
            else:
                result.reward_sum += sum(s.reward for s in group)
                result.n_scored += len(group)
                if group_filter(group):
                    result.accepted.append(group)
                    result.completion_tokens += sum(len(s.response_ids) for s in group)
                    continue
                result.n_filtered += 1
            if result.n_launched < cap:
                launch()
        # Full: cut the surplus short. Finished samples of unfinished groups are kept.
        cut = dict(running)
        for _, _, ctx in cut.values():
            if ctx is None:
                continue
            with trio.move_on_after(5) as scope:
                scope.shield = True
                for rid in list(ctx.in_flight):
                    await _abort_quietly(engine, rid)
        nursery.cancel_scope.cancel()
    # A group cut off may have finished (and reported) while the aborts above were under way:
    # it is held once, with every sample it finished, never also as a surplus group below.
    result.partial += [(prompt, _finished(done)) for prompt, done, _ in cut.values()]
    # groups that finished between the last receive and the cancel are surplus too
    while True:
        try:
            gid, kind, prompt, samples = recv.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            break
        if kind == "done" and gid not in cut:
            result.partial.append((prompt, _finished(samples)))
    result.wall_time_s = time.perf_counter() - started
    return result


def _n_rollouts(group: Sequence[Sample]) -> int:
    """Rollouts in a group: its samples less the extra ones (`Sample.sub_index` > 0)."""
    return sum(s.sub_index == 0 for s in group)


def _missing_indices(done: Sequence[Sample], n_samples: int) -> list[int]:
    """Indices in the group with no sample yet, or a failed one (an extra sample included)."""
    failed = {s.index_in_group for s in done if s.status == "failed"}
    ok = {s.index_in_group for s in done} - failed
    return [i for i in range(n_samples) if i not in ok]


def _transient(exc: EngineError) -> bool:
    """Worth generating again: no answer, a timeout or a 5xx (a 4xx would fail again)."""
    return exc.status is None or exc.status >= 500


def _finished(samples: Sequence[Sample]) -> list[Sample]:
    """The samples worth keeping for a later try of their group: not cut short by an abort."""
    return [s for s in samples if s.status != "aborted"]


async def _abort_quietly(engine: GenerateEngine, rid: str) -> None:
    try:
        await engine.abort(rid)
    except (EngineError, RolloutsError) as err:
        log.warning("abort of %s failed: %s", rid, err)


_cap_warned = False


def _log_cap_reached(cap: int, accepted: int, wanted: int) -> None:
    """A WARNING the first time in a process, DEBUG after: with DAPO's dynamic sampling on an
    easy or hard task the cap is reached at most steps, and a line per step buries the step
    lines (the batch's group count shows it in the metrics)."""
    global _cap_warned
    level = logging.DEBUG if _cap_warned else logging.WARNING
    _cap_warned = True
    log.log(level, "over-sampling cap of %d groups reached with %d/%d accepted (a smaller batch; "
            "later ones are logged at DEBUG)", cap, accepted, wanted)  # fmt: skip
