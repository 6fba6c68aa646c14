"""run_sft_training: the supervised fine-tuning loop, a pure async function.

It owns no state: the model, optimizer and step live in the backend, the data cursor in the
DataBuffer. Resume therefore means loading those components' state from the latest checkpoint.
Reads top to bottom: maybe resume → per step: batch → forward_backward + optim_step → maybe
eval → log → maybe checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from training.backend.checkpoint import find_latest_checkpoint, reclaim_temp_dirs
from training.backend.pytorch import PyTorchTrainingBackend
from training.config import SFTLoopConfig
from training.data.buffer import DataBuffer
from training.loops.hooks import SFTEvaluateFn, SFTHooks

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


async def run_sft_training(
    backend: PyTorchTrainingBackend,
    data: SFTData,
    config: SFTLoopConfig,
    *,
    hooks: SFTHooks = SFTHooks(),
    resolved_config: dict[str, Any] | None = None,
    extra_state: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Train until `config.max_steps` optimizer steps are done, or `config.max_wall_s` passed.

    Args:
        backend: owns the model and optimizer; its `checkpoint_dir` is where resume looks.
        data: training DataBuffer (of tokenized samples) and held-out samples.
        config: the loop section of the run config.
        hooks: logger and extra evaluation (`training.loops.hooks.SFTHooks`); none by default.
        resolved_config: the full run config, saved with each checkpoint.
        extra_state: more JSON-able state saved with each checkpoint (the recipe stores the
            fingerprint of the data it trains on).

    Returns:
        The metrics of each step run by this call (empty when resuming a finished run).
    """
    start = await maybe_resume(backend, data.train, config)
    history: list[dict[str, Any]] = []
    began = time.perf_counter()
    for step in range(start + 1, config.max_steps + 1):
        t0 = time.perf_counter()
        samples = data.train.get_prompts(config.batch_size)
        fb = backend.forward_backward(samples)
        opt = backend.optim_step()
        metrics: dict[str, Any] = {**await fb.result(), **await opt.result()}
        elapsed = time.perf_counter() - t0
        metrics["step_time_s"] = elapsed
        metrics["tokens_per_s"] = metrics["n_tokens"] / elapsed
        metrics["trained_tokens_per_s"] = metrics["n_trained_tokens"] / elapsed
        metrics["epoch"] = data.train.epoch_id
        last = step == config.max_steps or (
            config.max_wall_s is not None and time.perf_counter() - began >= config.max_wall_s
        )
        if step % config.eval_every == 0 or last:
            metrics.update(await evaluate(backend, data, hooks.evaluate_fn))
        if hooks.logger is not None:
            hooks.logger(step, metrics)
        history.append(metrics)
        if step % config.checkpoint_every == 0 or last:
            extra = {**(extra_state or {}), "data_buffer": data.train.state_dict(),
                     "config": resolved_config or {}}  # fmt: skip
            await backend.save_checkpoint(step, metrics, extra_state=extra)
        if last:
            break
    return history
