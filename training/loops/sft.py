"""run_sft_training: the supervised fine-tuning loop, a pure async function.

It owns no state: the model, optimizer and step live in the backend, the data cursor in the
DataBuffer. Resume therefore means loading those components' state from the latest checkpoint.
Reads top to bottom: run length → maybe resume → per step: batch → forward_backward +
optim_step → maybe eval (and watch for overfitting) → log → maybe checkpoint (and mark the
best).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.backend.checkpoint import (
    STATE_JSON,
    find_latest_checkpoint,
    mark_best_checkpoint,
    prune_checkpoints,
    reclaim_temp_dirs,
)
from training.backend.pytorch import PyTorchTrainingBackend
from training.config import SFTLoopConfig
from training.data.buffer import DataBuffer
from training.loops.eval_watch import EvalWatch
from training.loops.hooks import SFTEvaluateFn, SFTHooks
from training.loops.run_length import sft_run_length

log = logging.getLogger("rollouts.sft")
# maybe_resume runs in the RL loop too: its lines are about checkpoints, not SFT
checkpoint_log = logging.getLogger("rollouts.checkpoint")


@dataclass(frozen=True)
class SFTData:
    """What the SFT loop trains and evaluates on: a DataBuffer of tokenized samples + held-out."""

    train: DataBuffer
    eval_samples: Sequence[Any] = ()


async def maybe_resume(backend: PyTorchTrainingBackend, buffer: DataBuffer, config: Any) -> int:
    """Restore backend and data cursor from the latest checkpoint when `config.resume == "auto"`.

    Shared by the SFT and RL loops (`config` is either loop's config section).

    Returns:
        The number of steps already done (0 for a fresh run).
    """
    for stale in reclaim_temp_dirs(backend.checkpoint_dir):
        checkpoint_log.warning("removed %s, left by a checkpoint write that did not finish", stale)
    if config.resume != "auto":
        return 0
    latest = find_latest_checkpoint(backend.checkpoint_dir)
    if latest is None:
        return 0
    extra = await backend.load_checkpoint(latest)
    buffer.load_state_dict(extra["data_buffer"])
    checkpoint_log.info("resumed from %s at step %d", latest, backend.step)
    return backend.step


def saved_extra(checkpoint_dir: Path) -> dict[str, Any]:
    """The extra state of the latest checkpoint in `checkpoint_dir` ({}: none)."""
    latest = find_latest_checkpoint(checkpoint_dir)
    if latest is None:
        return {}
    return json.loads((latest / STATE_JSON).read_text(encoding="utf-8")).get("extra", {})


async def evaluate(
    backend: PyTorchTrainingBackend, data: SFTData, evaluate_fn: SFTEvaluateFn | None
) -> dict[str, float]:
    """Held-out loss, plus whatever `evaluate_fn` measures (e.g. greedy accuracy)."""
    metrics: dict[str, float] = {}
    if data.eval_samples:
        metrics["eval_loss"] = (await backend.forward(data.eval_samples).result())["loss"]
    if evaluate_fn is not None:
        metrics.update(await evaluate_fn(backend))
    return metrics


async def save_checkpoint(backend: PyTorchTrainingBackend, step: int, metrics: dict[str, Any],
                          extra: dict[str, Any], *, best: bool) -> None:  # fmt: skip
    """Save step `step`; when `best`, link it as `checkpoints/best` (train.keep_best)."""
    await backend.save_checkpoint(step, metrics, extra_state=extra)
    if best:  # then prune again: the previous best is no longer kept for being the best
        mark_best_checkpoint(backend.checkpoint_dir, step)
        if backend.keep_last is not None:
            prune_checkpoints(backend.checkpoint_dir, backend.keep_last)


async def run_sft_training(
    backend: PyTorchTrainingBackend,
    data: SFTData,
    config: SFTLoopConfig,
    *,
    hooks: SFTHooks = SFTHooks(),
    resolved_config: dict[str, Any] | None = None,
    extra_state: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Train for the run's length (`sft_run_length`), or until `config.max_wall_s` passed.

    Args:
        backend: owns the model and optimizer; its `checkpoint_dir` is where resume looks. Its
            `max_steps` (the LR schedule's horizon) should be `sft_run_length(...).steps`.
        data: training DataBuffer (of tokenized samples) and held-out samples.
        config: the loop section of the run config.
        hooks: logger and extra evaluation (`training.loops.hooks.SFTHooks`); none by default.
        resolved_config: the full run config, saved with each checkpoint.
        extra_state: more JSON-able state saved with each checkpoint (the recipe stores the
            fingerprint of the data it trains on).

    Returns:
        The metrics of each step run by this call (empty when resuming a finished run).
    """
    length = sft_run_length(config, len(data.train))
    log.info("%s", length.message)
    if config.keep_best and not data.eval_samples:
        log.warning("train.keep_best is on but there is no held-out data (data.eval_path, "
                    "--eval-data) to rank checkpoints by: no checkpoints/best will be kept")  # fmt: skip
    start = await maybe_resume(backend, data.train, config)
    watch = EvalWatch()
    if start:
        watch.load_state_dict(saved_extra(backend.checkpoint_dir).get("eval_watch", {}))
    history: list[dict[str, Any]] = []
    train_losses: list[float] = []  # since the last evaluation, for the overfitting check
    began = time.perf_counter()
    for step in range(start + 1, length.steps + 1):
        t0 = time.perf_counter()
        samples = data.train.get_prompts(length.batch_at(step))
        fb = backend.forward_backward(samples)
        opt = backend.optim_step()
        metrics: dict[str, Any] = {**await fb.result(), **await opt.result()}
        elapsed = time.perf_counter() - t0
        metrics["step_time_s"] = elapsed
        metrics["tokens_per_s"] = metrics["n_tokens"] / elapsed
        metrics["trained_tokens_per_s"] = metrics["n_trained_tokens"] / elapsed
        metrics["epoch"] = data.train.epoch_id
        train_losses.append(metrics["loss"])
        last = step == length.steps or (
            config.max_wall_s is not None and time.perf_counter() - began >= config.max_wall_s
        )
        best = False
        if step % length.eval_every == 0 or last:
            metrics.update(await evaluate(backend, data, hooks.evaluate_fn))
            if "eval_loss" in metrics:
                mean_train = sum(train_losses) / len(train_losses)
                best = watch.observe(step, metrics["eval_loss"], mean_train)
            train_losses = []
        if hooks.logger is not None:
            hooks.logger(step, metrics)
        history.append(metrics)
        keep_best = best and config.keep_best
        if step % config.checkpoint_every == 0 or last or keep_best:
            extra = {**(extra_state or {}), "data_buffer": data.train.state_dict(),
                     "eval_watch": watch.state_dict(), "config": resolved_config or {}}  # fmt: skip
            await save_checkpoint(backend, step, metrics, extra, best=keep_best)
        if last:
            break
    if history and watch.best_step is not None:
        where = f" ({backend.checkpoint_dir / 'best'})" if config.keep_best else ""
        log.info("lowest eval loss %.4f at step %d%s", watch.best_eval_loss, watch.best_step, where)
    return history
