"""`sync_weights_to_engines`: push a checkpoint to every engine, concurrently, and verify it.

Contract (per engine, all engines at once): pause → flush the cache (pause mode "abort" only:
the engine is then idle; retried while it still answers 400, at most `flush_retries` times, as
slime does) → `update_weights_from_disk(dir, version, flush_cache=False)` → read `/model_info`
and check it reports `version` → continue. The update never asks for its own flush: with
requests kept in the engine (pause "in_place"/"retract") SGLang 0.5.23 refuses that flush with a
400 and does not set the version (0.5.1–0.5.14 crash on an assert).
- Every engine that was paused is resumed, whatever happened: a failure, another engine's
  failure, or cancellation (the resume runs shielded, bounded by `resume_timeout_s`).
- An engine that cannot be reached (`EngineUnavailableError`: dead, restarting) is skipped and
  logged, and the sync goes on with the live ones; it fails only if no engine took the weights.
  Each engine's `expected_weights` (path, version) is set first, so an `EnginePool` gives a
  skipped or restarted engine these weights before it serves again.
- Engines do not cancel each other: each finishes its own sequence, then one `WeightSyncError`
  names every engine that failed with the server's message. Engines that succeeded keep the new
  weights (SGLang keeps the old ones on a failed load), so after an error the fleet may be
  mixed; the error says which engine has what.
- Returns the wall time of the whole sync in seconds.

`pause_engines` + `sync_weights_to_engines(..., paused=True)` split the same sequence in two, so
a caller can pause first (requests sent after that wait in the engine and run on the new
weights) and let the rest finish in the background (`training.loops.rl` does).

Not covered: rollback of the engines that succeeded; NCCL/tensor-based refit.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import trio

from rollouts.errors import EngineError

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
) -> float:
    """Update every engine's weights from `checkpoint_dir` and label them `weight_version`.

    Args:
        engines: the engines to update (e.g. `pool.engines`).
        checkpoint_dir: HF-layout directory the engines can read (same filesystem).
        weight_version: the new label; each engine must report it afterwards.
        pause_mode: how in-flight requests are paused ("abort" aborts them, as SGLang's RL
            recipe does; "retract"/"in_place" keep them, finishing under the new weights).
        paused: every engine is already paused (`pause_engines`); skip the pause.
        flush_retries, flush_retry_s: bound on the flush before the update (pause "abort").

    Returns:
        Seconds the sync took.

    Raises:
        WeightSyncError: one or more engines failed; the message names each with its reason.
    """
    path = os.path.abspath(checkpoint_dir)
    failures: dict[str, list[str]] = {}
    down: dict[str, str] = {}
    started = time.perf_counter()

    async def sync_one(engine: InferenceEngine) -> None:
        is_paused = paused
        if hasattr(engine, "expected_weights"):
            engine.expected_weights = (path, weight_version)  # type: ignore[attr-defined]
        try:
            if not is_paused:
                await engine.pause(pause_mode)
                is_paused = True
            if pause_mode == "abort":
                await _flush(engine, flush_retries, flush_retry_s)
            await engine.update_weights_from_disk(path, weight_version, flush_cache=False)
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
            with trio.CancelScope(shield=True), trio.move_on_after(resume_timeout_s) as scope:
                try:
                    await engine.resume()
                except EngineUnavailableError as exc:
                    down.setdefault(engine.url, str(exc))
                except EngineError as exc:
                    failures.setdefault(engine.url, []).append(
                        f"could not be resumed, it may still be paused: {exc}"
                    )
            if scope.cancelled_caught and is_paused:
                failures.setdefault(engine.url, []).append(
                    f"resume timed out after {resume_timeout_s} s"
                )

    async with trio.open_nursery() as nursery:
        for engine in engines:
            nursery.start_soon(sync_one, engine)
    duration = time.perf_counter() - started
    for url, reason in down.items():
        logger.warning("weight sync %s skipped %s, which is down: %s", weight_version, url, reason)
    if len(down) == len(engines) and not failures:
        failures = {url: [f"down: {reason}"] for url, reason in down.items()}
    if failures:
        lines = [f"{url}: {'; '.join(reasons)}" for url, reasons in failures.items()]
        raise WeightSyncError(
            f"weight sync to {weight_version!r} from {path} failed on {len(failures)} of "
            f"{len(engines)} engine(s):\n  " + "\n  ".join(lines)
        )
    logger.debug("synced weights %s to %d engine(s) in %.3f s", weight_version,
                 len(engines) - len(down), duration)  # fmt: skip
    return duration


async def _flush(engine: InferenceEngine, retries: int, retry_s: float) -> None:
    """Flush an idle (paused, aborted) engine's cache; it answers 400 until aborts settle."""
    for attempt in range(retries + 1):
        try:
            await engine.flush_cache()
            return
        except EngineError as exc:
            if exc.status != 400 or attempt == retries:
                raise EngineError(
                    f"cache flush before the weight update failed after {attempt + 1} "
                    f"attempt(s): {exc}",
                    url=engine.url,
                ) from exc
            logger.warning("%s: cache not flushed yet (%s); retrying", engine.url, exc)
            await trio.sleep(retry_s * 2**attempt)


async def pause_engines(engines: Sequence[InferenceEngine], pause_mode: PauseMode = "abort", *,
                        resume_timeout_s: float = 30.0) -> None:  # fmt: skip
    """Pause every engine, concurrently; follow with `sync_weights_to_engines(..., paused=True)`.

    Requests sent after this returns wait in the engines until they are resumed.

    An engine that cannot be reached is skipped (logged): the sync that follows skips it too.

    Raises:
        WeightSyncError: an engine answered the pause with an error, or none could be reached;
            every engine is resumed first (the message names each failure).
    """
    failures: dict[str, str] = {}
    down: dict[str, str] = {}

    async def pause_one(engine: InferenceEngine) -> None:
        try:
            await engine.pause(pause_mode)
        except EngineUnavailableError as exc:
            down[engine.url] = str(exc)
        except EngineError as exc:
            failures[engine.url] = str(exc)

    async with trio.open_nursery() as nursery:
        for engine in engines:
            nursery.start_soon(pause_one, engine)
    for url, reason in down.items():
        logger.warning("not pausing %s for a weight sync: it is down (%s)", url, reason)
    if len(down) == len(engines):
        failures.update(down)
    if not failures:
        return
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
