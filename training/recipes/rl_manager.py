"""The RL recipe's rollout manager: in the trainer's process, or over rollout worker processes.

`rollout.workers: 0` (the default) builds `AsyncRolloutManager` over the recipe's engine, as
before; K > 0 builds `WorkerRolloutManager` (rollouts/workers/manager.py) over the engines'
URLs, each worker importing `reward.fn` itself. What workers cannot run yet is refused here,
naming the setting to change (the config-level refusals are in `RLRunConfig`).
"""

from __future__ import annotations

from typing import Any

from engines.client_settings import client_settings
from plumbing.errors import ConfigError
from rollouts.manager import AsyncRolloutManager
from rollouts.workers.manager import WorkerRolloutManager


def check_worker_extensions(config: Any, extensions: Any) -> None:
    """Refuse what cannot cross to a worker process: a reward given as a Python object."""
    if config.rollout.workers and getattr(config, "teacher", None) is not None:
        raise ConfigError(
            f"rollout.workers={config.rollout.workers} with algorithm.preset=distill: the "
            "teacher scores samples in the trainer's process; set rollout.workers=0"
        )
    if config.rollout.workers and extensions.reward_fn is not None:
        raise ConfigError(
            f"rollout.workers={config.rollout.workers}: a reward given as a Python object "
            "(RLExtensions.reward_fn, rollouts.quick_rl) cannot reach a worker process; name it "
            "in reward.fn as module:function, or set rollout.workers=0"
        )


def build_rollout_manager(config: Any, engine: Any, clients: list[Any], buffer: Any, *,
                          reward_fn: Any, extensions: Any, episodes: Any, backend: Any,
                          tokenizer: Any, generate_fn: Any = None) -> Any:  # fmt: skip
    """The manager `run_rl_training` draws its batches from (see the module docstring);
    `generate_fn` replaces the episodes' (distillation: scored by the teacher too)."""
    version = lambda: backend.weight_version  # noqa: E731
    if not config.rollout.workers:
        return AsyncRolloutManager(  # the loop gives it each step's algorithm
            engine, buffer, config.rollout, reward_fn=reward_fn,
            transforms=extensions.transforms, current_version=version,
            tokenizer=tokenizer, generate_fn=generate_fn or episodes.generate_fn,
        )  # fmt: skip
    check_worker_extensions(config, extensions)
    return WorkerRolloutManager(
        [c.url for c in clients], buffer, config.rollout, reward=config.reward.fn,
        transforms=extensions.transforms, current_version=version,
        engine_weights=lambda: pushed_version(clients),
        engines=client_settings(config.engines),  # its workers' clients are built as ours
        paused_engines=lambda: {c.url for c in clients if getattr(c, "paused", False)},
    )  # fmt: skip


def pushed_version(clients: list[Any]) -> str | None:
    """The weight version the trainer's last push gave its engines (`expected_weights`, set
    first by each push, also for an engine that is down); None before the first push."""
    return next((c.expected_weights[1] for c in clients
                 if getattr(c, "expected_weights", None) is not None), None)  # fmt: skip
