"""Weight pushes by broadcast (`engines.weight_transport: distributed`): SGLang's distributed
refit, no file written unless an engine needs one.

`start_distributed_push` is `start_push`'s counterpart (weight_push.py) with the same
contract (pause → update → verify version → continue; returns once the engines are paused,
the rest finishes in the caller's nursery; a failure raises `WeightSyncError` there):
1. The group (engines/refit.py) is formed, or re-formed when the engines that answer changed.
2. The engines are paused; the backend's `broadcast_weights` is queued at once, so the weights
   sent are this step's, whatever the loop queues next. It gathers each bucket (FSDP2: whole
   parameters, one bucket at a time) and broadcasts it while each engine's
   `/update_weights_from_distributed` call for that bucket waits for it.
3. The engines report the version and are resumed.

Faults: an engine that is down or does not answer is left out of the group, and that push
also writes the HF export under `weights/` for it (the pool gives it those weights when it
comes back, as with disk); the push succeeds with the members alone, even when every engine
left out is down. With every engine down there is no group: the whole push goes through
disk, which waits up to `unavailable_timeout_s` for an engine to come back (issue 49 item
D1). A broadcast that fails (an engine died or stalled mid-way: every collective is under the
group's deadline) tears the group down; the same queued operation
then writes the export, and every live engine loads it from disk (the disk contract), so the
run goes on; the next push re-forms the group without the missing engine.

LoRA adapters always travel through disk (they are small; `/load_lora_adapter`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from engines.pause_renewal import renewing_pauses
from engines.refit import RefitGroup, receive_on_engines, resume_updated
from engines.weight_sync import pause_engines, sync_weights_to_engines
from plumbing.errors import EngineError
from training.backend.pytorch import PyTorchTrainingBackend
from training.backend.weight_buckets import plan_buckets

log = logging.getLogger("rollouts.rl")


async def start_distributed_push(backend: PyTorchTrainingBackend, engines: Sequence[Any],
                                 export_root: Path, nursery: trio.Nursery, group: RefitGroup, *,
                                 pause_mode: str = "abort", done: Any,
                                 unavailable_timeout_s: float = 60.0) -> None:  # fmt: skip
    """Push `backend`'s weights to `engines` by broadcast (module docstring); `done` is the
    `PendingPush` whose `engines_s` and `done` this fills in."""
    version = str(backend.weight_version)
    out = export_root / f"v{backend.weight_version:06d}"
    plan = plan_buckets(backend.model, group.bucket_bytes)
    members = await group.ensure(engines)
    left_out = [e for e in engines if e not in members]
    await pause_engines(engines, pause_mode, wait_s=unavailable_timeout_s)
    if not members:  # no group this time: the whole push goes the disk path, in queue order
        path = await backend.export_weights(out)
        future = None
    else:
        verdict: dict[str, Any] = {}
        heard = trio.Event()
        token = trio.lowlevel.current_trio_token()
        limit_s = group.timeout_s * 2

        def confirm() -> bool:  # trainer thread, after the last bucket: did every engine load it?
            async def wait() -> bool:
                with trio.move_on_after(limit_s):
                    await heard.wait()
                return heard.is_set() and not verdict["failures"]

            return trio.from_thread.run(wait, trio_token=token)

        group.start_push()
        device = "cuda" if group.backend == "nccl" else "cpu"  # where the backend sends from
        future = backend.broadcast_weights(group.send, plan, out, export=bool(left_out),
                                           confirm=confirm, device=device)  # fmt: skip

    async def finish() -> None:
        t0 = time.perf_counter()
        try:  # the pauses are renewed for as long as the push holds them, including the wait
            # for a failed broadcast's deadline after every receive has ended (issue 49)
            async with renewing_pauses(engines):
                await update()
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(30.0):  # never leave one paused
                await group.close(engines)  # ends any receive still waiting for the trainer
                for engine in engines:
                    with contextlib.suppress(EngineError):
                        await engine.resume()
            raise
        finally:
            done.engines_s = time.perf_counter() - t0
            done.done.set()

    async def update() -> None:
        if future is None:  # every engine down waits for one, as a disk push does
            await sync_weights_to_engines(engines, path, version, pause_mode=pause_mode,
                                          paused=True, wait_s=unavailable_timeout_s)  # fmt: skip
            return

        async def engines_part() -> None:
            verdict["failures"] = await receive_on_engines(group, members, plan, version,
                                                           pause_mode=pause_mode)  # fmt: skip
            heard.set()

        async with trio.open_nursery() as inner:
            inner.start_soon(engines_part)
            failed, exported = await future.result()
        failures = verdict["failures"]
        if failed is None and not failures:
            await resume_updated(members, version, None if exported is None else str(exported))
            if left_out:  # the members took the weights: the left out need not (down, as a rule)
                await sync_weights_to_engines(left_out, exported, version, pause_mode=pause_mode,
                                              paused=True, required=False)  # fmt: skip
            return
        log.warning("weight push %s by broadcast failed (%s); the engines load it from disk (%s) "
                    "and the group is re-formed at the next push", version,
                    "; ".join([*([str(failed)] if failed else []),
                               *(f"{url}: {'; '.join(why)}" for url, why in failures.items())]),
                    exported)  # fmt: skip
        await group.close(engines)
        await sync_weights_to_engines(engines, exported, version, pause_mode=pause_mode,
                                      paused=True, wait_s=unavailable_timeout_s)  # fmt: skip

    nursery.start_soon(finish)
