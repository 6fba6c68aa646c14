"""`sync_weights_to_engines`: push a checkpoint to every engine, concurrently, and verify it.

Contract (per engine, all engines at once): pause → flush the prefix cache → `update_weights_
from_disk(dir, version, flush_cache=False)` → read `/model_info` and check it reports `version`
→ continue. No KV computed by the old weights is reused after the sync, in any pause mode:
- "abort" and "retract": the flush right after the pause. SGLang 0.5.23 flushes when no request
  is running and, while paused, ignores the waiting ones (`is_fully_idle(ignore_waiting=
  self._engine_paused)`): after "abort" the engine is idle, after "retract" the running
  requests are back in the waiting queue and are recomputed on resume (`PauseGenerationReqInput`:
  "The KV cache can be flushed in this mode"). Retried while it answers 400 (aborts settling),
  at most `flush_retries` times, as slime does; then the sync fails for that engine.
- "in_place": requests keep running on their KV, so SGLang refuses any flush (and an update
  that asks for one fails without setting the version). The cache is namespaced instead:
  every request the client sends carries `extra_key = engine.kv_namespace`, which `pause()`
  renews, so nothing sent after the pause matches a prefix cached before it. The in-place
  requests themselves finish on KV that mixes old and new weights; their
  `meta_info.weight_versions` spans say so.
- Every engine that was paused is resumed, whatever happened: a failure, another engine's
  failure, or cancellation (the resume runs shielded, bounded by `resume_timeout_s`).
- An engine that cannot be reached (`EngineUnavailableError`: dead, restarting), or that an
  `EnginePool` knows is down (`engine.known_down`, not tried), is skipped and logged, and the
  sync goes on with the live ones. Each engine's `expected_weights` (path, version) is set
  first, so an `EnginePool` gives a skipped or restarted engine these weights before it serves
  again. When every engine is down the sync waits up to `wait_s` for one to come back
  (`engines.unavailable_timeout_s`, as a request does), and fails only if none took the
  weights by then (engines/sync_steps.py; issue 49 item D1).
- A load that does not answer within `update_bound_s` (30 s + 10 s/GB by default) is given up:
  that engine counts as down, not failed, and is no longer held paused (engines/sync_steps.py;
  issue 49 item D3).
- Engines do not cancel each other: each finishes its own sequence, then one `WeightSyncError`
  names every engine that failed with the server's message. Engines that succeeded keep the new
  weights (SGLang keeps the old ones on a failed load), so after an error the fleet may be
  mixed; the error says which engine has what.
- While it holds an engine paused it renews the pause's lease (`renewing_pauses`): a trainer
  killed mid-sync leaves a local engine paused for at most `engine.pause_lease_s`.
- Returns the wall time of the whole sync in seconds.

`pause_engines` + `sync_weights_to_engines(..., paused=True)` split the same sequence in two, so
a caller can pause first (requests sent after that wait in the engine and run on the new
weights) and let the rest finish in the background (`training.loops.rl` does).

Not covered: rollback of the engines that succeeded. Weights by broadcast instead of from disk
(SGLang's distributed refit): engines/refit.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import trio

from plumbing.errors import EngineError

from .lora import LoraAdapterError
from .sync_steps import (
    down_level,
    give_up,
    leave_known_down,
    run_on_every_engine,
    update_bound_s,
    weights_gb,
)
from .sync_steps import flush as _flush
from .sync_steps import raise_failures as _raise_failures
from .sync_steps import resume_noting as _resume_noting
from .types import EngineUnavailableError, InferenceEngine, PauseMode, WeightSyncError

logger = logging.getLogger(__name__)


async def sync_weights_to_engines(
    engines: Sequence[InferenceEngine],
    checkpoint_dir: str | os.PathLike[str],
    weight_version: str,
    *,
    pause_mode: PauseMode = "abort",
    paused: bool = False,
    resume_timeout_s: float = 30.0,
    flush_retries: int = 5,
    flush_retry_s: float = 0.2,
    wait_s: float = 0.0,
    required: bool = True,
    rejoin: bool = False,
) -> float:
    """Update every engine's weights from `checkpoint_dir` and label them `weight_version`.

    Args:
        engines: the engines to update (e.g. `pool.engines`).
        checkpoint_dir: HF-layout directory the engines can read (same filesystem).
        weight_version: the new label; each engine must report it afterwards.
        pause_mode: how in-flight requests are paused ("abort" aborts them, as SGLang's RL
            recipe does; "retract" recomputes them on the new weights; "in_place" keeps their
            KV, so they finish on mixed weights).
        paused: every engine is already paused (`pause_engines`); skip the pause.
        flush_retries, flush_retry_s: bound on the flush before the update ("abort", "retract").
        wait_s: when every engine is down, how long to wait for one to come back and take the
            weights before failing (`engines.unavailable_timeout_s`; engines/sync_steps.py).
        required: False where other engines already have these weights (the engines left out
            of a broadcast): every engine down is then no error.
        rejoin: the pool's rejoin: it syncs an engine it counts as down, and gives the weights
            a push recorded for it without recording them again (a push meanwhile wins).

    Returns:
        Seconds the sync took.

    Raises:
        WeightSyncError: one or more engines failed; the message names each with its reason.
    """
    path = os.path.abspath(checkpoint_dir)
    failures: dict[str, list[str]] = {}
    down: dict[str, str] = {}
    started = time.perf_counter()
    gb = await trio.to_thread.run_sync(weights_gb, path)

    async def sync_one(engine: InferenceEngine, is_paused: bool = paused) -> None:
        # A push records what the engine should serve; a rejoin gives what was recorded and
        # must not overwrite a push recorded while it ran (the pool's rejoin then gives that
        # one too: engines/pool_membership.py)
        if not rejoin and hasattr(engine, "expected_weights"):
            engine.expected_weights = (path, weight_version)  # type: ignore[attr-defined]
        if not rejoin and getattr(engine, "known_down", False):  # given them on rejoin
            leave_known_down(engine, down)
            return
        try:
            if not is_paused:
                await engine.pause(pause_mode)
                is_paused = True
            if pause_mode != "in_place":  # "in_place" relies on `kv_namespace` (module doc)
                await _flush(engine, flush_retries, flush_retry_s)
            bound_s = update_bound_s(engine, gb)
            with trio.move_on_after(bound_s) as load:
                await engine.update_weights_from_disk(path, weight_version, flush_cache=False)
            if load.cancelled_caught:  # it hangs: down, not failed (engines/sync_steps.py)
                give_up(engine, down, "/update_weights_from_disk", bound_s, gb)
                return
            info = await engine.model_info()
            if info.weight_version != weight_version:
                failures.setdefault(engine.url, []).append(
                    f"reports weight_version {info.weight_version!r} after the update, "
                    f"expected {weight_version!r}"
                )
        except EngineUnavailableError as exc:
            down[engine.url] = str(exc)
        except EngineError as exc:
            failures.setdefault(engine.url, []).append(str(exc))
        finally:
            # Also after a failed pause: the request may have reached the server.
            await _resume_noting(engine, is_paused, resume_timeout_s, down, failures)

    what = f"weight sync to {weight_version!r} from {path}"
    await run_on_every_engine(engines, sync_one, weight_version, down, wait_s, what)
    duration = time.perf_counter() - started
    await _raise_failures(what, len(engines), down, failures, required=required)
    logger.debug("synced weights %s to %d engine(s) in %.3f s", weight_version,
                 len(engines) - len(down), duration)  # fmt: skip
    return duration


async def pause_engines(engines: Sequence[InferenceEngine], pause_mode: PauseMode = "abort", *,
                        resume_timeout_s: float = 30.0, activate_lora: str | None = None,
                        wait_s: float = 0.0) -> None:  # fmt: skip
    """Pause every engine, concurrently; follow with `sync_weights_to_engines(..., paused=True)`
    (or `sync_lora_to_engines(..., paused=True)`).

    Requests sent after this returns wait in the engines until they are resumed. With
    `activate_lora` (the name the LoRA sync that follows loads), each paused engine's
    `active_lora` becomes that name at once, so those requests name the new adapter; the
    engine resolves it after the sync's resume, when it is loaded (SGLang resolves adapter
    names only once a pause is over).

    An engine that cannot be reached is skipped (logged): the sync that follows skips it too.
    With `wait_s` > 0 (the `wait_s` of that sync) none reachable is no error here: the sync
    waits for one to come back.

    Raises:
        WeightSyncError: an engine answered the pause with an error, or none could be reached
            (and `wait_s` is 0); every engine is resumed first (the message names each failure).
    """
    failures: dict[str, str] = {}
    down: dict[str, str] = {}
    previous: dict[Any, str | None] = {}  # active_lora before `activate_lora`

    async def pause_one(engine: InferenceEngine) -> None:
        if getattr(engine, "known_down", False):  # the sync that follows skips it too
            leave_known_down(engine, down)
            return
        try:
            await engine.pause(pause_mode)
            if activate_lora is not None:
                previous[engine] = getattr(engine, "active_lora", None)
                engine.active_lora = activate_lora  # type: ignore[attr-defined]
        except EngineUnavailableError as exc:
            down[engine.url] = str(exc)
        except EngineError as exc:
            failures[engine.url] = str(exc)

    async with trio.open_nursery() as nursery:
        for engine in engines:
            nursery.start_soon(pause_one, engine)
    for url, reason in down.items():
        logger.log(down_level(reason), "not pausing %s for a weight sync: it is down (%s)", url,
                   reason)  # fmt: skip
    if len(down) == len(engines) and wait_s <= 0:
        failures.update(down)
    if not failures:
        return
    for engine, active in previous.items():
        engine.active_lora = active
    with trio.CancelScope(shield=True), trio.move_on_after(resume_timeout_s):
        async with trio.open_nursery() as nursery:
            for engine in engines:
                nursery.start_soon(_resume_quietly, engine)
    lines = [f"{url}: {reason}" for url, reason in failures.items()]
    raise WeightSyncError(
        f"pausing {len(failures)} of {len(engines)} engine(s) for a weight sync failed (all were "
        "resumed):\n  " + "\n  ".join(lines)
    )


async def _resume_quietly(engine: InferenceEngine) -> None:
    try:
        await engine.resume()
    except EngineError as exc:
        logger.warning("could not resume %s after a failed pause: %s", engine.url, exc)


def lora_version_name(name: str, version: int) -> str:
    """The versioned adapter name a LoRA push is loaded under: `f"{name}-v{version}"`."""
    if not name or not isinstance(version, int) or version < 0:
        raise ValueError(f"lora_version_name needs a name and a version >= 0, got {name!r}, "
                         f"{version!r}")  # fmt: skip
    return f"{name}-v{version}"


async def sync_lora_to_engines(
    engines: Sequence[InferenceEngine],
    adapter_dir: str | os.PathLike[str],
    lora_name: str,
    weight_version: str,
    *,
    keep: int = 2,
    pause_mode: PauseMode = "abort",
    paused: bool = False,
    resume_timeout_s: float = 30.0,
    wait_s: float = 0.0,
    rejoin: bool = False,
) -> float:
    """Load the adapter in `adapter_dir` (peft layout) on every engine as `lora_name`, make it
    the adapter generation uses, and label the weights `weight_version`.

    Per engine, all at once: pause (unless `paused`) → `engine.active_lora = lora_name` (so
    requests sent from now on, which wait in the paused engine, name the new adapter; SGLang
    resolves adapter names only once a pause is over) → `/load_lora_adapter` (absolute path;
    an adapter already loaded under this name from this path counts as loaded, so a retry or
    a rejoin is harmless) → check `loaded_adapters` lists it → `/update_weight_version` →
    `/model_info` reports the version → resume → unload the adapters this client loaded
    before, oldest first, beyond the newest `keep` (never the active one). Unloading comes
    after the resume because SGLang waits for the requests still using an adapter; a failed
    unload is logged and retried at the next sync.

    Failure semantics are `sync_weights_to_engines`'s: every paused engine is resumed; an
    engine that cannot be reached is skipped and logged (`expected_lora` and
    `expected_weights` are set first, so an `EnginePool` loads the adapter on it when it comes
    back); one `WeightSyncError` names every engine that failed (they keep their old active
    adapter); with every engine down it waits up to `wait_s` for one, and fails if no engine
    took the adapter; a load past `update_bound_s` counts that engine down. Returns seconds.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the active adapter stays loaded), got {keep}")
    path = os.path.abspath(adapter_dir)
    failures: dict[str, list[str]] = {}
    down: dict[str, str] = {}
    started = time.perf_counter()
    gb = await trio.to_thread.run_sync(weights_gb, path)

    async def load_one(engine: Any) -> bool:
        bound_s = update_bound_s(engine, gb)
        try:
            with trio.move_on_after(bound_s) as load:
                loaded = await engine.load_lora_adapter(lora_name, path)
        except LoraAdapterError as exc:
            if exc.loaded_adapters.get(lora_name) != path:
                raise
            loaded = exc.loaded_adapters  # already there from this path: a retry or a rejoin
        if load.cancelled_caught:  # it hangs: down, not failed (engines/sync_steps.py)
            give_up(engine, down, "/load_lora_adapter", bound_s, gb)
            return False
        if lora_name not in loaded:
            failures.setdefault(engine.url, []).append(
                f"loaded_adapters {sorted(loaded)} does not list {lora_name!r} after the load"
            )
            return False
        have = getattr(engine, "lora_loaded", [])
        engine.lora_loaded = [n for n in have if n in loaded and n != lora_name] + [lora_name]
        await engine.update_weight_version(weight_version, abort_all_requests=False)
        info = await engine.model_info()
        if info.weight_version != weight_version:
            failures.setdefault(engine.url, []).append(
                f"reports weight_version {info.weight_version!r} after the update, "
                f"expected {weight_version!r}")  # fmt: skip
            return False
        return True

    async def sync_one(engine: Any, is_paused: bool = paused) -> None:
        loaded = False
        if not rejoin:  # a push records; a rejoin never overwrites (sync_weights_to_engines)
            previous = getattr(engine, "expected_weights", None)
            engine.expected_weights = (previous[0] if previous else None, weight_version)
            engine.expected_lora = (lora_name, path)
        if not rejoin and getattr(engine, "known_down", False):
            leave_known_down(engine, down)
            engine.active_lora = lora_name  # it is given the adapter on rejoin
            return
        try:
            if not is_paused:
                await engine.pause(pause_mode)
                is_paused = True
            # From here requests name the new adapter; they wait in the paused engine, which
            # resolves names only once the pause is over (SGLang's tokenizer manager too).
            engine.active_lora = lora_name
            loaded = await load_one(engine)
        except EngineUnavailableError as exc:
            down[engine.url] = str(exc)
            engine.active_lora = lora_name  # it is given the adapter on rejoin
        except EngineError as exc:
            failures.setdefault(engine.url, []).append(str(exc))
        finally:
            if not loaded and engine.url not in down:  # refused: back to the newest it has
                have = [n for n in getattr(engine, "lora_loaded", []) if n != lora_name]
                engine.active_lora = have[-1] if have else None
            await _resume_noting(engine, is_paused, resume_timeout_s, down, failures)
        if loaded:
            await _unload_old(engine, keep)

    what = f"LoRA sync of {lora_name!r} ({weight_version!r}) from {path}"
    await run_on_every_engine(engines, sync_one, weight_version, down, wait_s, what)
    duration = time.perf_counter() - started
    await _raise_failures(what, len(engines), down, failures)
    logger.debug("synced LoRA %s to %d engine(s) in %.3f s", lora_name,
                 len(engines) - len(down), duration)  # fmt: skip
    return duration


async def _unload_old(engine: Any, keep: int) -> None:
    """Unload this client's adapters beyond the newest `keep`, oldest first, never the active."""
    active = getattr(engine, "active_lora", None)
    names: list[str] = list(getattr(engine, "lora_loaded", []))
    for name in [n for n in names if n != active][: max(0, len(names) - keep)]:
        try:
            await engine.unload_lora_adapter(name)
        except LoraAdapterError as exc:
            if name in exc.loaded_adapters:
                logger.warning("%s: could not unload LoRA %s (retried at the next sync): %s",
                               engine.url, name, exc)  # fmt: skip
                continue
        except EngineError as exc:
            logger.warning("%s: could not unload LoRA %s (retried at the next sync): %s",
                           engine.url, name, exc)  # fmt: skip
            continue
        names.remove(name)
    engine.lora_loaded = names
