"""Colocated mode (`engines.colocate: true`): generation and training take turns on one node's
memory (issue 47 item 3).

The cycle of each step, in sync mode: the batch is generated → every engine releases its
weights' and KV cache's memory (`/release_memory_occupation`) → the trainer trains → every
engine takes its memory back (`/resume_memory_occupation`) → the step's weights are pushed
into it (pause → load → verify → continue, as in every mode) → the next batch. The loop is
unchanged: `ColocatedRollouts` wraps the rollout manager, releasing once `generate_batch`
returns and resuming in `settle()`, which the loop awaits before each push. A resumed engine
holds no weights until that push (the local engine refuses requests until then, with a
message naming the cause), so the recipe resumes and pushes at the start of a run. With
`engines.weight_transport: disk`, the push goes through memory when the node has a tmpfs
(`/dev/shm`): `colocated_weights_dir`.

Engines the pool knows are down are skipped (it gives them the current weights when they come
back); an engine that refuses (busy: the release needs an idle engine) is asked again for a
few seconds, then the step fails naming it. Every call has the engine's control deadline.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from engines.types import EngineUnavailableError, WeightSyncError
from plumbing.errors import EngineError

log = logging.getLogger("rollouts.rl")

_RETRY_S = 0.2
_BUSY_WAIT_S = 10.0  # how long a release waits for an engine still finishing aborted requests


async def release_engines(engines: Sequence[Any]) -> None:
    """Every engine (not known down) releases its memory; raises WeightSyncError naming those
    that refused."""
    await _on_every_engine(engines, "release_memory_occupation", "releasing the memory of")


async def resume_engines(engines: Sequence[Any]) -> None:
    """Every engine (not known down) takes its memory back (no weights until the next push)."""
    await _on_every_engine(engines, "resume_memory_occupation", "resuming the memory of")


async def _on_every_engine(engines: Sequence[Any], method: str, what: str) -> None:
    failures: dict[str, str] = {}

    async def one(engine: Any) -> None:
        if getattr(engine, "known_down", False):
            return
        deadline = trio.current_time() + _BUSY_WAIT_S
        while True:
            try:
                await getattr(engine, method)()
                return
            except EngineUnavailableError as exc:  # down: the pool's rejoin gives it weights
                log.warning("%s %s skipped: it is down (%s)", what, engine.url, exc)
                return
            except EngineError as exc:
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


def colocated_weights_dir(out: Path, shm: Path = Path("/dev/shm")) -> Path:
    """Where a colocated run's disk pushes go: a folder of its own in tmpfs (memory) when the
    node has one the process can write, else `out / "weights"` (a real disk)."""
    if shm.is_dir() and os.access(shm, os.W_OK):
        tag = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]
        return shm / f"rollouts-weights-{tag}"
    log.warning("engines.colocate: no writable %s on this node; weight pushes go through %s",
                shm, out / "weights")  # fmt: skip
    return out / "weights"


class ColocatedRollouts:
    """A rollout manager whose engines rest while the trainer trains (the module docstring);
    everything else is the wrapped manager's."""

    def __init__(self, manager: Any, engines: Sequence[Any]) -> None:
        self._manager, self._engines = manager, list(engines)

    async def generate_batch(self) -> Any:
        batch = await self._manager.generate_batch()
        await release_engines(self._engines)  # nothing generates while the trainer trains
        return batch

    async def settle(self) -> None:  # before each weight push: the engines take memory back
        settle = getattr(self._manager, "settle", None)
        if settle is not None:
            await settle()
        await resume_engines(self._engines)

    async def __aenter__(self) -> ColocatedRollouts:
        await self._manager.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._manager.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:  # data_state, use_algorithm, statistics, ...
        return getattr(self._manager, name)
