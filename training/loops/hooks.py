"""RLHooks and SFTHooks: the callables a loop tells about its progress, all optional.

A hook observes (logs, evaluates, dumps rollouts, decides when to stop); it never changes what
is optimized — that is `training.rl.objective.RLObjective`. Grouping them keeps the loops'
signatures to components + objective + hooks, the same shape for SFT and RL.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from rollouts.types import RolloutBatch
from training.backend.pytorch import PyTorchTrainingBackend
from training.loops.loggers import Logger
from training.rl.algorithms import AlgorithmConfig

EvaluateFn: TypeAlias = Callable[[], Awaitable[dict[str, float]]]
"""RL held-out evaluation (through the engines); its metrics are logged with an `eval_` prefix."""
SFTEvaluateFn: TypeAlias = Callable[[PyTorchTrainingBackend], Awaitable[dict[str, float]]]
"""SFT's extra evaluation of the backend being trained (e.g. greedy accuracy)."""
StopFn: TypeAlias = Callable[[int, Mapping[str, Any]], bool]
"""(step, that step's metrics) -> True to stop after this step (its checkpoint is written)."""
CheckpointHook: TypeAlias = Callable[[int, Path, Mapping[str, Any]], None]
"""(step, checkpoint directory, that step's metrics), called after each checkpoint is written."""
BatchHook: TypeAlias = Callable[[int, RolloutBatch], None]
"""(step, that step's RolloutBatch), e.g. `training.rl.rollout_dump.RolloutDumpWriter`."""


@dataclass(frozen=True)
class RLHooks:
    """What `run_rl_training` calls as it goes.

    Args:
        logger: called with (step, metrics) after every step.
        evaluate_fn: held-out evaluation through the engines, every `eval_every` steps.
        stop_fn: called with (step, metrics) after logging; True ends the run after this
            step's checkpoint.
        checkpoint_hook: called with (step, checkpoint path, metrics) after each checkpoint.
        on_batch: called with (step, rollout batch) for each batch trained on (e.g.
            `training.rl.rollout_dump.RolloutDumpWriter`).
        on_algorithm_switch: called with the next step's algorithm when it differs from this
            step's (after the rollout manager's `use_algorithm`).
    """

    logger: Logger | None = None
    evaluate_fn: EvaluateFn | None = None
    stop_fn: StopFn | None = None
    checkpoint_hook: CheckpointHook | None = None
    on_batch: BatchHook | None = None
    on_algorithm_switch: Callable[[AlgorithmConfig], None] | None = None


@dataclass(frozen=True)
class SFTHooks:
    """What `run_sft_training` calls as it goes.

    Args:
        logger: called with (step, metrics) after every step.
        evaluate_fn: extra evaluation run every `eval_every` steps and at the end (the held-out
            loss is measured without it).
    """

    logger: Logger | None = None
    evaluate_fn: SFTEvaluateFn | None = None
