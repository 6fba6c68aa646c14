"""A rollout worker process: generates and scores the groups the trainer sends it.

Started by `WorkerRolloutManager` as `python -m rollouts.workers.worker` with frames
(rollouts/workers/frames.py) on stdin and stdout; anything the worker prints or logs goes to
stderr (stdout is the frame stream). The protocol, one frame each:

- trainer → worker, first: `{"kind": "start", "worker": k, "engine_urls": [...], "rollout":
  RolloutConfig fields, "reward": "module:function", "engines": the run's client and pool
  settings (engines/client_settings.py: keys, generate timeout, stall bound...)}`. The worker
  builds its clients and `EnginePool` from them as the trainer builds its own, and imports the
  reward itself; it answers
  `{"kind": "ready", "pid": ...}`.
- trainer → worker: `{"kind": "collect", "request": id, "rid_prefix": str, "prompts":
  [{"prompt": PromptItem dict, "samples": [held Sample dicts]}], "overlong": null | {...},
  "engine_weights": the version of the trainer's last push, or null, "abort": [rid prefixes],
  "paused": [the worker's engine URLs the trainer has paused now], "paused_seq": n}`:
  the worker's pool uses no engine serving older weights (`EnginePool(follows_weights=True)`);
  it first aborts, on its engines, the requests of the `abort` prefixes (those a lost worker
  before it left running).
  The worker generates every prompt's group (`collect_groups`, no filter: the trainer filters)
  and answers `{"kind": "groups", "request": id, "groups": [...], "slots": [...], "partial":
  [...], "stats": {...}}` with the groups' tokens in flat buffers; `slots[i]` is the index of
  group i's prompt in the request, `partial` the slots cut short (an engine paused with abort)
  with their finished samples, `stats` the collection's counters.
- trainer → worker, at any time (also while a collection runs; never answered): `{"kind":
  "paused", "urls": [...], "paused_seq": n}`, the worker's engines the trainer has paused now (a
  weight push, as `"paused"` of a collect frame): requests wait behind that pause by design, so
  the pool's stall watch does not count that time (engines/stall.py, `mark_paused_elsewhere`).
  `paused_seq` numbers the trainer's paused states, each newer one higher: the worker applies a
  state only if it is newer than the last it applied, so its view is the newest the trainer sent
  whatever order the two kinds of frame are read or applied in (a collect frame's is applied when
  its collection starts, after a "paused" frame that came right behind it). A state without
  `paused_seq` is applied as it comes.
- a failure the trainer must not retry (a reward that raised under `reward_fail_fast`, an
  engine error under `engine_fail_fast`) is answered `{"kind": "error", "message": ...}`.
- stdin closed (or the process killed): the worker ends. The trainer's nursery owns the process.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import trio

from plumbing.errors import EngineError, RolloutsError, leaf_errors
from rollouts.config import RolloutConfig
from rollouts.generation import CollectResult, GroupSource, collect_groups
from rollouts.groups import keep_all
from rollouts.prompts import PromptItem
from rollouts.reward_threads import RewardThreads
from rollouts.rewards import RewardFn, add_overlong_shaping
from rollouts.types import Sample
from rollouts.workers.frames import FrameReader, encode_frame, encode_groups

log = logging.getLogger("rollouts.workers.worker")

COUNTERS = ("n_launched", "n_filtered", "n_failed_groups", "n_failed_samples",
            "n_retried_samples", "n_reward_failed", "n_interrupted", "completion_tokens",
            "reward_sum", "n_scored", "wall_time_s")  # fmt: skip
TALLIES = ("failures", "sample_errors", "reward_errors", "generation_errors")


def import_reward(spec: str) -> RewardFn:
    """The reward named `module:function`."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise RolloutsError(f"reward {spec!r} is not module:function (e.g. "
                            "rollouts.tasks.arithmetic:correctness_reward)")  # fmt: skip
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise RolloutsError(f"rollout worker cannot import the reward {spec!r}: {err}; the "
                            "module must be importable in the worker (PYTHONPATH)") from err  # fmt: skip


def result_stats(result: CollectResult) -> dict[str, Any]:
    """The counters of a collection, JSON-ready (the inverse: `stats_result`)."""
    return {**{k: getattr(result, k) for k in COUNTERS},
            **{k: dict(getattr(result, k)) for k in TALLIES}}  # fmt: skip


def stats_result(stats: Mapping[str, Any]) -> CollectResult:
    result = CollectResult(accepted=[], partial=[], **{k: stats[k] for k in COUNTERS})
    for key in TALLIES:
        getattr(result, key).update(stats[key])
    return result


class Worker:
    """One worker's state: its engines, reward and config (see the module docstring)."""

    def __init__(self, start: Mapping[str, Any], engine: Any, clients: Sequence[Any] = ()
                 ) -> None:  # fmt: skip
        self.index = start["worker"]
        self.clients = list(clients)  # the pool's, one per engine URL
        self.config = RolloutConfig.model_validate(start["rollout"])
        self.task_reward = import_reward(start["reward"])
        self.engine = engine
        self.limiter = trio.CapacityLimiter(self.config.max_concurrency)
        self.threads = RewardThreads(self.config.reward_threads,
                                     max_hung=self.config.reward_max_hung)  # fmt: skip
        self.paused_seq = 0  # the number of the trainer's paused state applied last

    async def collect(self, request: Mapping[str, Any]) -> bytes:
        cfg = self.config
        # held samples (a group a push cut short) carry their launch number in the collection
        # that made them: given the slot's, the group comes back whole in its slot (`_slot`)
        prompts = [(PromptItem.from_dict(p["prompt"]),
                    [replace(Sample.from_dict(s), group_id=slot) for s in p["samples"]])
                   for slot, p in enumerate(request["prompts"])]  # fmt: skip
        queue = iter(prompts)
        self.mark_paused(request.get("paused", ()), request.get("paused_seq"))
        self.engine.expect_weights(request.get("engine_weights"))
        await abort_left_running(self.engine, request.get("abort", ()))
        reward = self.task_reward
        if (overlong := request.get("overlong")) is not None:
            reward = add_overlong_shaping(reward, **overlong)
        result = await collect_groups(
            GroupSource(lambda: next(queue)), n_groups=len(prompts),
            n_samples=cfg.n_samples_per_prompt, engine=self.engine,
            sampling_params=cfg.sampling.params(), reward_fn=reward, group_filter=keep_all,
            limiter=self.limiter, max_launches=len(prompts), reward_timeout_s=cfg.reward_timeout_s,
            reward_fail_fast=cfg.reward_fail_fast, reward_threads=self.threads,
            engine_fail_fast=cfg.engine_fail_fast, sample_retries=cfg.sample_retries,
            reward_failure_value=cfg.reward_failure_value, rid_prefix=request["rid_prefix"],
            warn_at_cap=False,  # the trainer draws replacements: a short answer is no short batch
        )  # fmt: skip
        slot_of = {id(p): i for i, (p, _) in enumerate(prompts)}
        slots = [_slot(g, len(prompts)) for g in result.accepted]
        order = sorted(range(len(slots)), key=slots.__getitem__)
        groups = [result.accepted[i] for i in order]
        partial = [{"slot": slot_of[id(p)], "samples": [s.to_dict() for s in done]}
                   for p, done in result.partial]  # fmt: skip
        records, buffers = encode_groups(groups)
        header = {"kind": "groups", "request": request["request"], "groups": records,
                  "slots": [slots[i] for i in order], "partial": partial,
                  "stats": result_stats(result)}  # fmt: skip
        return encode_frame(header, buffers)

    def mark_paused(self, urls: Sequence[str], seq: int | None = None) -> None:
        """The trainer has the engines at `urls` paused (a weight push), and no others: their
        requests wait behind the pause by design, which the stall watch does not count. `seq`
        is the trainer's number of that state: one not newer than the state applied last is
        stale and ignored (see the module docstring)."""
        if seq is not None:
            if seq <= self.paused_seq:
                return
            self.paused_seq = seq
        for client in self.clients:
            client.mark_paused_elsewhere(client.url in urls)


async def abort_left_running(engine: Any, prefixes: Sequence[str], timeout_s: float = 10.0
                             ) -> None:  # fmt: skip
    """Abort every request whose rid starts with one of `prefixes` on the pool's engines (best
    effort, bounded by `timeout_s`: an engine that is down has nothing running)."""
    with trio.move_on_after(timeout_s):
        for prefix in prefixes:
            try:
                await engine.abort(prefix)
            except* EngineError as group:
                log.warning("could not abort the requests %s* a lost worker left: %s", prefix,
                            "; ".join(str(e) for e in leaf_errors(group)))  # fmt: skip


def _slot(group: tuple[Sample, ...], n_prompts: int) -> int:
    """The request slot of a finished group: its samples' group_id is its launch number (the
    held ones' set to it by `Worker.collect`), and the worker launches the request's prompts in
    order, one launch each (no replacement)."""
    gid = group[0].group_id
    if not 0 <= gid < n_prompts:
        raise RolloutsError(f"rollout worker: a group came back with group_id {gid}, not one "
                            f"of the request's {n_prompts} launches (a generate_fn that sets "
                            "Sample.group_id itself is not supported with rollout.workers)")  # fmt: skip
    return gid


async def serve(stdin: trio.abc.ReceiveStream, stdout: trio.abc.SendStream) -> None:
    """Answer the trainer's frames until stdin ends (see the module docstring)."""
    from engines import EnginePool, SGLangEngine  # the process's engines, opened here
    from engines.client_settings import client_options, pool_options

    reader = FrameReader(stdin, what="the worker's stdin")
    first = await reader.receive()
    if first is None:
        return
    start = first[0]
    if start.get("kind") != "start":
        raise RolloutsError(f"rollout worker: the first frame must be 'start', got {start!r}")
    import_reward(start["reward"])  # before the engines: a bad name ends the worker at once
    async with contextlib.AsyncExitStack() as stack:
        settings = start.get("engines") or {}  # built as the trainer's (engines/client_settings.py)
        engines = [await stack.enter_async_context(SGLangEngine(
                       url, **client_options(settings), retry_generate=False))  # the pool retries
                   for url in start["engine_urls"]]  # fmt: skip
        # the trainer gives the weights: the pool uses no engine it has not given them yet
        pool = EnginePool(engines, **pool_options(settings), follows_weights=True)
        worker = Worker(start, await stack.enter_async_context(pool), engines)
        await stdout.send_all(encode_frame({"kind": "ready", "pid": os.getpid()}))
        requests_in, requests = trio.open_memory_channel[dict[str, Any]](math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer, worker, requests, stdout)
            async with requests_in:  # closed at the end of stdin: the last answer still goes
                while (frame := await reader.receive()) is not None:
                    if frame[0].get("kind") == "paused":  # read while a collection runs
                        worker.mark_paused(frame[0]["urls"], frame[0].get("paused_seq"))
                    else:
                        requests_in.send_nowait(frame[0])


async def _answer(worker: Worker, requests: trio.MemoryReceiveChannel, stdout: trio.abc.SendStream
                  ) -> None:  # fmt: skip
    """Answer each request in turn, as the trainer sends them (one at a time per worker)."""
    async for request in requests:
        try:
            reply = await worker.collect(request)
        except* (EngineError, RolloutsError) as group:
            message = "; ".join(f"{type(e).__name__}: {e}" for e in leaf_errors(group))
            reply = encode_frame({"kind": "error", "request": request.get("request"),
                                  "message": message})  # fmt: skip
        await stdout.send_all(reply)


def main() -> None:
    """Frames on fd 0 and fd 1; everything else the process writes goes to stderr."""
    frames_out = os.dup(1)
    os.dup2(2, 1)  # a print() in a reward must not corrupt the frame stream
    sys.stdout = sys.stderr
    logging.basicConfig(level=os.environ.get("ROLLOUTS_WORKER_LOG", "WARNING"), stream=sys.stderr,
                        format="worker %(process)d %(levelname)s %(name)s: %(message)s")  # fmt: skip

    async def run() -> None:
        stdin = trio.lowlevel.FdStream(os.dup(0))
        stdout = trio.lowlevel.FdStream(frames_out)
        async with stdin, stdout:
            await serve(stdin, stdout)

    trio.run(run)


if __name__ == "__main__":
    main()
