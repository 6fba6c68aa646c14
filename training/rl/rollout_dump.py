"""Rollout dumps: every step's RolloutBatch as one JSONL line, and replaying them into training.

A dump line is `{"step": N, **batch.to_dict()}`: token ids, engine logprobs, masks, rewards and
their components, statuses, tool calls — everything the trainer used, so a step can be
re-trained offline (`replay_rollout_dump`) to debug a loss, compare algorithms on identical
data, or reproduce a spike without engines. Write one with `RolloutDumpWriter` as the RL
loop's `on_batch` (the recipe does so when `train.dump_rollouts` is true).

The writer appends, so a resumed run continues the same file; a step that ran twice (a crash
after dumping, before its checkpoint) then appears twice and `read_rollout_dump` keeps the
last. Not covered: dumps are not compressed (~100 bytes per token).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from plumbing.errors import DataError
from rollouts.jsonl import format_errors, iter_jsonl
from rollouts.types import RolloutBatch
from training.backend.pytorch import PyTorchTrainingBackend
from training.rl.advantages import AdvantageFn
from training.rl.algorithms import AlgorithmConfig, PolicyLossFn, compute_policy_loss
from training.rl.kl import KLFn
from training.rl.step import train_on_batch


class RolloutDumpWriter:
    """Append each `(step, batch)` to `path` as one JSON line (flushed per line).

    Usable directly as `run_rl_training(on_batch=RolloutDumpWriter(path))`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def __call__(self, step: int, batch: RolloutBatch) -> None:
        self._file.write(json.dumps({"step": step, **batch.to_dict()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_rollout_dump(path: str | Path) -> dict[int, RolloutBatch]:
    """The batches of a dump file by step (the last line wins for a repeated step).

    Raises:
        DataError: a line is not JSON or not a valid batch record (names the file and line).
        OSError: the file cannot be read.
    """
    errors: list[str] = []
    batches: dict[int, RolloutBatch] = {}
    for source, obj in iter_jsonl(path, errors):
        try:
            if not isinstance(obj, dict) or not isinstance(obj.get("step"), int):
                raise DataError('expected an object with an integer "step"')
            record = {k: v for k, v in obj.items() if k != "step"}
            batches[obj["step"]] = RolloutBatch.from_dict(record)
        except (DataError, TypeError) as err:
            errors.append(f"{source}: {err}")
    if errors:
        raise DataError(format_errors(errors, what=str(path)))
    return batches


async def replay_rollout_dump(
    backend: PyTorchTrainingBackend,
    path: str | Path,
    algorithm: AlgorithmConfig,
    *,
    steps: Iterable[int] | None = None,
    temperature: float = 1.0,
    old_from_rollout: bool = False,
    reference: PyTorchTrainingBackend | None = None,
    advantage_fn: AdvantageFn | None = None,
    policy_loss_fn: PolicyLossFn = compute_policy_loss,
    kl_fn: KLFn | None = None,
) -> dict[int, dict[str, Any]]:
    """Train `backend` on dumped batches (one `train_on_batch` each, in step order).

    Args:
        backend: the policy to update (e.g. loaded from the checkpoint before those steps).
        path: a dump written by `RolloutDumpWriter`.
        algorithm: the algorithm to train with (need not be the one of the original run).
        steps: which dumped steps to replay; default all.
        The other arguments are `train_on_batch`'s.

    Returns:
        Each replayed step's training metrics, by step.

    Raises:
        DataError: the dump is malformed, or a requested step is not in it.
    """
    batches = read_rollout_dump(path)
    wanted = sorted(batches) if steps is None else list(steps)
    missing = [s for s in wanted if s not in batches]
    if missing:
        raise DataError(f"{path}: steps {missing} are not in the dump (it has {sorted(batches)})")
    out: dict[int, dict[str, Any]] = {}
    for step in wanted:
        out[step] = await train_on_batch(
            backend, batches[step], algorithm, temperature=temperature,
            old_from_rollout=old_from_rollout, reference=reference, advantage_fn=advantage_fn,
            policy_loss_fn=policy_loss_fn, kl_fn=kl_fn,
        )  # fmt: skip
    return out
