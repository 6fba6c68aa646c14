"""Weight pushes: export the trainer's weights and load them into every engine.

`push_weights` waits for the engines; `start_push` returns once they are paused and finishes
their load in a nursery the caller owns, so the RL loop trains its next step meanwhile (requests
sent to a paused engine wait and run on the new weights). With LoRA only the adapter travels.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from engines.refit import RefitGroup
from engines.weight_sync import (
    lora_version_name,
    pause_engines,
    sync_lora_to_engines,
    sync_weights_to_engines,
)
from plumbing.nursery import open_nursery
from training.backend.pytorch import PyTorchTrainingBackend
from training.loops.refit_push import start_distributed_push

log = logging.getLogger("rollouts.rl")


async def push_weights(backend: PyTorchTrainingBackend, engines: Sequence[Any], export_root: Path,
                       *, pause_mode: str = "abort", keep: int = 2,
                       refit: RefitGroup | None = None,
                       unavailable_timeout_s: float = 60.0) -> float:  # fmt: skip
    """Export the current weights (HF layout) and load them into every engine; with LoRA
    (`backend.lora`) export only the adapter and load it as `<name>-v<version>` (see
    `start_push`).

    Returns:
        Seconds for export + sync.
    """
    t0 = time.perf_counter()
    async with open_nursery() as nursery:  # `start_push`, waiting for its background part
        await start_push(backend, engines, export_root, nursery, pause_mode=pause_mode, keep=keep,
                         refit=refit, unavailable_timeout_s=unavailable_timeout_s)  # fmt: skip
    return time.perf_counter() - t0


@dataclass
class PendingPush:
    """A weight push whose engines are paused and whose load finishes in the background."""

    done: trio.Event = field(default_factory=trio.Event)
    engines_s: float | None = None  # update + verify + resume, once done


async def start_push(backend: PyTorchTrainingBackend, engines: Sequence[Any], export_root: Path,
                     nursery: trio.Nursery, *, pause_mode: str = "abort", keep: int = 2,
                     refit: RefitGroup | None = None,
                     unavailable_timeout_s: float = 60.0) -> PendingPush:  # fmt: skip
    """`push_weights` with the engines' part in `nursery`: returns once every engine is paused.

    From then on any request sent to the engines (the next batch, an evaluation) waits in them
    and runs on the new weights, so the order of the loop is kept, while the trainer goes on
    with its next step instead of waiting for the engines to load (update, verify and resume:
    ~10 ms a step over loopback for the tiny model, more for real ones). A failure raises
    `WeightSyncError` in `nursery`.

    Engines that are down are skipped (each is given these weights when it comes back); when
    every engine is down the push waits up to `unavailable_timeout_s` for one to come back and
    take them, in every transport, as a request waits for an engine (issue 49 item D1).

    With LoRA the export is the adapter alone (peft's layout) and each engine loads it with
    `/load_lora_adapter` as `<lora.name>-v<version>`, makes it the adapter its generation
    requests name, and unloads the versions beyond the newest `lora.keep`; the weight version
    label moves as for full weights, so staleness accounting is the same.

    With `refit` (`engines.weight_transport: distributed`) full weights are broadcast to the
    engines over that group instead (training/loops/refit_push.py): nothing is written unless
    an engine needs a disk copy. LoRA adapters still travel through disk.
    """
    if refit is not None and backend.lora is None:
        pending = PendingPush()
        await start_distributed_push(backend, engines, export_root, nursery, refit,
                                     pause_mode=pause_mode, done=pending,
                                     unavailable_timeout_s=unavailable_timeout_s)  # fmt: skip
        return pending
    version = backend.weight_version
    path = await backend.export_weights(export_root / f"v{version:06d}")
    lora = backend.lora
    name = None if lora is None else lora_version_name(lora.name, version)
    # With LoRA the paused engines name the new adapter at once: requests sent before the
    # background sync loads it (the next batch) wait for it and run on it, as for full weights.
    await pause_engines(engines, pause_mode, activate_lora=name, wait_s=unavailable_timeout_s)
    pending = PendingPush()

    async def finish() -> None:
        t0 = time.perf_counter()
        try:
            if lora is None or name is None:
                await sync_weights_to_engines(engines, path, str(version),
                                              pause_mode=pause_mode, paused=True,
                                              wait_s=unavailable_timeout_s)  # fmt: skip
            else:
                await sync_lora_to_engines(engines, path, name, str(version), keep=lora.keep,
                                           pause_mode=pause_mode, paused=True,
                                           wait_s=unavailable_timeout_s)  # fmt: skip
            # An adapter still loaded may be reloaded from its path (SGLang does so for a name
            # unloaded and asked for again): keep the exports of every loaded version.
            _prune_exports(export_root, keep if lora is None else max(keep, lora.keep + 1))
        finally:
            pending.engines_s = time.perf_counter() - t0
            pending.done.set()

    nursery.start_soon(finish)
    return pending


class WeightsCopies:
    """Disk copies of the trainer's weights for an engine that comes back after a push that
    went by broadcast (`EnginePool.weights_copy`, `leave_engines_on_final_weights`'s export):
    `await copies(version)` -> (path, version) under `export_root`, written once per version.

    The copy is the backend's weights in queue order: the read of its `weight_version` and the
    HF export are queued back to back on its ordered worker (nothing can run between them), so
    the version returned is exactly the one the files hold. It is the asked `version` (the last
    push's) unless the backend stepped since, when the copy holds, and is named and labelled
    with, the newer version: an engine serves it truthfully until the next push.
    """

    def __init__(self, backend: PyTorchTrainingBackend, export_root: Path) -> None:
        self.backend, self.export_root = backend, Path(export_root)
        self._lock = trio.Lock()  # engines rejoining at once share one export
        self._last: tuple[str, str] | None = None

    async def __call__(self, version: str) -> tuple[str, str]:
        async with self._lock:
            if self._last is not None and self._last[1] == version \
                    and Path(self._last[0]).exists():  # fmt: skip
                return self._last
            backend = self.backend
            read = backend.call(lambda: backend.weight_version)  # queued right before the export
            path = await backend.export_weights(self.export_root / f"v{int(version):06d}")
            exported = await read.result()
            target = self.export_root / f"v{exported:06d}"
            if str(exported) != version and not target.exists():
                path = Path(path).rename(target)
            log.info("wrote a copy of weights %d to %s for an engine back after a broadcast "
                     "push", exported, path)  # fmt: skip
            self._last = (str(path), str(exported))
            return self._last


def _prune_exports(export_root: Path, keep: int) -> None:
    for old in sorted(export_root.glob("v*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


async def leave_engines_on_final_weights(pool: Any, engines: Sequence[Any], version: int,
                                         export: Callable[[], Awaitable[Path]], *,
                                         timeout_s: float) -> tuple[str, ...]:  # fmt: skip
    """At a run's end, after its last push: every engine of `pool` that is down (a transient
    fault, a relaunch) is waited for, up to `timeout_s` in all (`engines.unavailable_timeout_s`),
    to answer again and be given the final weights `version` (`EnginePool.rejoin_down`); the
    URLs of the engines left behind, which the caller reports. Nothing is waited for when every
    engine serves, or when `pool` has no per-engine health (a gateway).

    An engine down since a push that went by broadcast has no copy on disk to be given: `export`
    writes one (the HF export of the final weights) and it is recorded as what they get.
    """
    rejoin_down = getattr(pool, "rejoin_down", None)
    down = [e for e in engines if getattr(e, "known_down", False)]
    if rejoin_down is None or not down:
        return ()
    if any((getattr(e, "expected_weights", None) or ("",))[0] is None for e in down):
        path = await export()  # recorded for the down engines, which the sync skips
        await sync_weights_to_engines(down, path, str(version), required=False)
    log.info("waiting up to %.0f s (engines.unavailable_timeout_s) for %s to come back and take "
             "the final weights %d", timeout_s, ", ".join(e.url for e in down), version)  # fmt: skip
    left = await rejoin_down(timeout_s)
    if left:
        log.warning("the run ends with %s down: not given the final weights %d",
                    ", ".join(left), version)  # fmt: skip
    return left
