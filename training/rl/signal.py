"""Learning signal: whether a step's groups can teach anything, and one warning when none has.

Group-relative advantages (GRPO, Dr.GRPO, RLOO, DAPO) are a sample's reward minus its group's
mean: a group whose samples all got the same reward has zero advantage everywhere and moves
nothing but the KL/entropy terms. A step where every group is like that trains on nothing, and
a run made of such steps ends with exit 0 and an unchanged model unless someone says so. This
module says so: each step's metrics count the equal-reward groups and set `no_signal`, and
after `patience` such steps in a row one WARNING names the likely cause.

What it does not do: stop the run (a task may start flat and pick up signal), or look at groups
a filter dropped before the batch was made (DAPO's dynamic sampling already refuses to train on
them; a batch left empty is `run_rl_training`'s empty-batch path).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rollouts.types import RolloutBatch, Sample

log = logging.getLogger("rollouts.rl")

DEFAULT_PATIENCE = 10


def has_equal_rewards(group: Sequence[Sample]) -> bool:
    """Whether every sample of `group` got the same reward (so its advantages are all zero)."""
    rewards = [s.reward for s in group]
    return max(rewards) - min(rewards) <= 1e-12


def signal_metrics(batch: RolloutBatch) -> dict[str, float]:
    """`groups_equal_reward` (how many of the batch's groups teach nothing) and `no_signal`
    (1.0 when that is every group)."""
    equal = sum(has_equal_rewards(g) for g in batch.groups)
    return {
        "groups_equal_reward": float(equal),
        "no_signal": float(bool(batch.groups) and equal == len(batch.groups)),
    }


def why_no_signal(rewards: Sequence[float]) -> str:
    """What a run whose recent groups all had equal rewards should change, from those rewards."""
    low, high = min(rewards), max(rewards)
    if high - low > 1e-12:
        return (f"each group's samples agree with each other (rewards {low:g}..{high:g} across "
                "groups): raise rollout.n_samples_per_prompt or rollout.sampling.temperature, "
                "or use a reward with partial credit")  # fmt: skip
    if low == 0.0:
        return (
            "every sample got reward 0: the model never succeeds at this task; start from "
            "an SFT checkpoint or use an easier task (or a reward with partial credit)"
        )
    return (f"every sample got the same reward {low:g}: the task is too easy for the model or "
            "the reward does not depend on the response; check the reward function")  # fmt: skip


class NoSignalWatch:
    """Per-step signal metrics, and one WARNING after `patience` steps in a row without signal.

    The warning fires once per stretch of such steps: a step with signal re-arms it.
    """

    def __init__(self, patience: int = DEFAULT_PATIENCE):
        self.patience = patience
        self._streak = 0
        self._rewards: list[float] = []  # of the current stretch, for the diagnosis
        self._warned = False

    def observe(self, step: int, batch: RolloutBatch) -> dict[str, float]:
        """This step's signal metrics; logs the warning on the `patience`-th flat step in a row."""
        metrics = signal_metrics(batch)
        if not metrics["no_signal"]:
            self._streak, self._rewards, self._warned = 0, [], False
            return metrics
        self._streak += 1
        if self._warned:  # said once for this stretch
            return metrics
        self._rewards.extend(s.reward for s in batch.samples)
        if self._streak >= self.patience:
            self._warned = True
            log.warning("no learning signal for %d steps (to step %d: every group's samples got "
                        "equal rewards, so every advantage is 0 and the model does not change): "
                        "%s", self._streak, step, why_no_signal(self._rewards))  # fmt: skip
        return metrics
