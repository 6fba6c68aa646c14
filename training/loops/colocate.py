"""Colocated mode (`engines.colocate: true`): generation and training take turns on one node's
memory (issue 47 item 3).

The cycle of each step, in sync mode: the batch is generated → every engine releases its
weights' and KV cache's memory (`/release_memory_occupation`) → the trainer trains → every
engine takes its memory back (`/resume_memory_occupation`) → the step's weights are pushed
into it (pause → load → verify → continue, as in every mode) → the next batch. The loop is
unchanged: `ColocatedRollouts` wraps the rollout manager, releasing once `generate_batch`
returns a batch with groups (an empty one is skipped by the loop, which asks again of the
engines: they stay up) and resuming in `settle()`, which the loop awaits before each push. A resumed engine
holds no weights until that push (the local engine refuses requests until then, with a
message naming the cause), so the recipe resumes and pushes at the start of a run. With
`engines.weight_transport: disk`, the push goes through memory when the node has a tmpfs
(`/dev/shm`): `colocated_weights_dir`.

Before the engines resume, the trainer gives its cached, unused GPU blocks back to the device
(`device_memory.give_back`): freed activations stay reserved by the caching allocator
otherwise, and the engines would resume into what is left beside the trainer's training peak.
Under torchrun every rank holds its own, so every rank does it (`ranks_give_back(backend)`:
one backend operation, in queue order after the step's training, on every rank) and the
resume waits for all of them; `memory_resumed_trainer_ranks_given_back` counts the ranks that
did, `memory_resumed_trainer_reserved_max_gib` (CUDA) is the most any rank still reserves.

What each phase holds is added to the step's metrics (issue 47: peak GPU memory per
phase): the engines' `memory_usage` summed (`/get_server_info`; the local engine's "weight"
and, on CUDA, "allocated", "reserved", "peak_allocated", engines/local/memory_occupation.py)
and the whole GPU's used memory seen from the trainer (`gpu_used`), as
`memory_{phase}_engines_{key}_gib` and `memory_{phase}_gpu_used_gib`, for the phases
"generated" (the batch done, before the release), "released" and "resumed" (taken back before
the push that preceded this batch's generation; absent at the first step). An engine that
does not answer is left out of the sums: a measurement never fails a step.

Engines the pool knows are down are asked too, once, and skipped if that fails (never failing
the step): one marked down while released (a transient fault during training) would otherwise
stay released for the rest of the run, since it refuses to generate while released, and the
pool's probe cannot see it back. Resumed, its client probes it with `/model_info` until weights
are loaded (engines/client_control.py), so the pool's rejoin gives it the current weights
(the push after the resume skips it, recording them); a down engine still holding its memory
after a step's batch gives it back while the trainer trains. Any other engine that refuses
(busy: the release needs an idle engine) is asked again for a few seconds, then the step fails
naming it; one that cannot be reached is skipped (the pool's rejoin gives it the weights).
Every call has the engine's control deadline.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio

from engines.types import EngineUnavailableError, WeightSyncError
from plumbing.errors import EngineError
from training.loops.device_memory import give_back, gpu_used_gib

log = logging.getLogger("rollouts.rl")

_RETRY_S = 0.2
_BUSY_WAIT_S = 10.0  # how long a release waits for an engine still finishing aborted requests
_DOWN_TRY_S = 10.0  # how long a release or resume waits for an engine known down (asked once)
_EXPORTS = 3  # a push's export beside the 2 kept (weight_push.py) while it is written
_MEASURE_S = 5.0  # how long a phase's memory figures may take (then what answered is kept)
# memory_usage keys in GiB: SGLang's ("weight", "kvcache", "graph") and the local engine's
_GIB_KEYS = ("weight", "kvcache", "graph", "allocated", "reserved", "peak_allocated")


async def release_engines(engines: Sequence[Any]) -> None:
    """Every engine releases its memory (one known down: if it can); raises WeightSyncError
    naming those that refused."""
    await _on_every_engine(engines, "release_memory_occupation", "releasing the memory of")


async def resume_engines(engines: Sequence[Any]) -> None:
    """Every engine takes its memory back (no weights until the next push; one known down: if
    it can, and the pool's rejoin gives it the weights)."""
    await _on_every_engine(engines, "resume_memory_occupation", "resuming the memory of")


async def _on_every_engine(engines: Sequence[Any], method: str, what: str) -> None:
    failures: dict[str, str] = {}

    async def one(engine: Any) -> None:
        down = getattr(engine, "known_down", False)
        deadline = trio.current_time() + _BUSY_WAIT_S
        while True:
            try:
                with trio.fail_after(_DOWN_TRY_S if down else math.inf):
                    await getattr(engine, method)()
                if down:
                    log.info("%s %s (known down): done", what, engine.url)
                return
            except EngineUnavailableError as exc:  # down: the pool's rejoin gives it weights
                log.warning("%s %s skipped: it is down (%s)", what, engine.url, exc)
                return
            except (EngineError, trio.TooSlowError) as exc:
                if down:  # asked once: never fails the step (module docstring)
                    log.warning("%s %s, known down, failed: %s", what, engine.url, exc)
                    return
                if trio.current_time() >= deadline:
                    failures[engine.url] = str(exc)
                    return
            await trio.sleep(_RETRY_S)

    async with trio.open_nursery() as nursery:
        for engine in engines:
            nursery.start_soon(one, engine)
    if failures:
        lines = "\n  ".join(f"{url}: {why}" for url, why in failures.items())
        raise WeightSyncError(f"{what} {len(failures)} of {len(engines)} engine(s) failed "
                              f"(engines.colocate):\n  {lines}")  # fmt: skip


def colocated_weights_dir(out: Path, shm: Path = Path("/dev/shm"), *,
                          model_bytes: int = 0) -> Path:  # fmt: skip
    """Where a colocated run's disk pushes go: a folder of its own in tmpfs (memory) when the
    node has one the process can write with room for `_EXPORTS` exports of `model_bytes`, else
    `out / "weights"` (a real disk). A container's /dev/shm is often 64 MiB (docker's default):
    an export that does not fit would fail the first push."""
    disk = out / "weights"
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        log.warning("engines.colocate: no writable %s on this node; weight pushes go through %s",
                    shm, disk)  # fmt: skip
        return disk
    free, need = shutil.disk_usage(shm).free, _EXPORTS * model_bytes
    if free < need:
        log.warning("engines.colocate: %s has %.2f GiB free, the pushes need %.2f GiB (%d "
                    "exports of the model); weight pushes go through %s", shm, free / 2**30,
                    need / 2**30, _EXPORTS, disk)  # fmt: skip
        return disk
    tag = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]
    return shm / f"rollouts-weights-{tag}"


async def phase_memory(engines: Sequence[Any], phase: str) -> dict[str, float]:
    """The engines' memory figures summed and the GPU's used memory now, as metrics of `phase`
    (module docstring; logged at DEBUG)."""
    sums: dict[str, float] = {}
    with trio.move_on_after(_MEASURE_S):
        for engine in engines:
            if getattr(engine, "known_down", False):
                continue
            try:
                states = (await engine.server_info()).get("internal_states") or [{}]
            except Exception as exc:  # a measurement never fails the step
                log.debug("memory of %s not read: %s", getattr(engine, "url", engine), exc)
                continue
            usage = states[0].get("memory_usage") or {}
            for key in _GIB_KEYS:
                if isinstance(usage.get(key), int | float):
                    sums[key] = sums.get(key, 0.0) + float(usage[key])
    out = {f"memory_{phase}_engines_{k}_gib": round(v, 4) for k, v in sums.items()}
    used = gpu_used_gib()
    if used is not None:
        out[f"memory_{phase}_gpu_used_gib"] = used
    log.debug("colocate memory, %s: %s", phase,
             ", ".join(f"{k} {v:g}" for k, v in out.items()) or "no figures")  # fmt: skip
    return out


GiveBack = Callable[[], Awaitable[list[dict[str, float]]]]  # -> each rank's give_back() report


def ranks_give_back(backend: Any) -> GiveBack:
    """The trainer's give-back on every rank of `backend` (its `on_every_rank`), after the
    work queued before it: under torchrun each rank's allocator holds its own activations."""

    async def every_rank() -> list[dict[str, float]]:
        return await backend.on_every_rank(give_back).result()

    return every_rank


async def give_back_here() -> list[dict[str, float]]:
    """This process's give-back only (a trainer of one process; its report in a list)."""
    return [await trio.to_thread.run_sync(give_back)]


def given_back_figures(reports: Sequence[dict[str, float]]) -> dict[str, float]:
    """The give-back's metrics (module docstring) from every rank's report."""
    out = {"memory_resumed_trainer_ranks_given_back": len({r["rank"] for r in reports})}
    reserved = [r["reserved_gib"] for r in reports if "reserved_gib" in r]
    if reserved:
        out["memory_resumed_trainer_reserved_max_gib"] = max(reserved)
    return out


class ColocatedRollouts:
    """A rollout manager whose engines rest while the trainer trains (the module docstring);
    everything else is the wrapped manager's. Before the engines resume, every rank of
    `trainer` (the policy's backend) gives its cached GPU memory back (`ranks_give_back`);
    without a trainer, this process does. `give_back` replaces either (a test's probe)."""

    def __init__(self, manager: Any, engines: Sequence[Any], *, trainer: Any = None,
                 give_back: GiveBack | None = None) -> None:  # fmt: skip
        self._manager, self._engines = manager, list(engines)
        here = give_back_here if trainer is None else ranks_give_back(trainer)
        self._give_back = give_back or here
        self._resumed: dict[str, float] = {}  # the last resume's figures, for the next batch

    async def generate_batch(self) -> Any:
        batch = await self._manager.generate_batch()
        if not batch.groups:  # skipped by the loop, which asks again: the engines stay up
            return batch
        figures = self._resumed | await phase_memory(self._engines, "generated")
        await release_engines(self._engines)  # nothing generates while the trainer trains
        figures |= await phase_memory(self._engines, "released")
        self._resumed = {}
        return replace(batch, metrics={**batch.metrics, **figures})

    async def settle(self) -> None:  # before each weight push: the engines take memory back
        settle = getattr(self._manager, "settle", None)
        if settle is not None:
            await settle()
        given = given_back_figures(await self._give_back())  # the trainer's cache, every rank's
        await resume_engines(self._engines)  # then the engines'
        self._resumed = given | await phase_memory(self._engines, "resumed")

    async def __aenter__(self) -> ColocatedRollouts:
        await self._manager.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._manager.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:  # data_state, use_algorithm, statistics, ...
        return getattr(self._manager, name)
