"""train_on_batch with several optimizer steps per rollout batch (mini-batches, epochs)."""

from __future__ import annotations

import pytest

from rollouts.errors import ConfigError
from tests.rl_helpers import batch_of, rl_backend
from training.config import load_config
from training.rl.algorithms import dapo, grpo, reinforce
from training.rl.batch import RLExample, split_mini_batches
from training.rl.step import train_on_batch
from training.rl_config import RLRunConfig

REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2], [0.3, 0.0, 1.0, 0.0], [1.0, 0.9, 0.0, 0.1]]


def example(group: int) -> RLExample:
    return RLExample((1, 2), (0, 1), 0.0, (), group=group)


def test_mini_batches_hold_whole_groups_in_order():
    examples = [example(g) for g in (0, 0, 0, 1, 2, 2, 3, 4, 4)]
    chunks = split_mini_batches(examples, 2)
    assert [[e.group for e in c] for c in chunks] == [[0, 0, 0, 1], [2, 2, 3, 4, 4]]
    assert [len(c) for c in split_mini_batches(examples, 5)] == [3, 1, 2, 1, 2]
    assert len(split_mini_batches(examples, 9)) == 5  # never more mini-batches than groups
    assert split_mini_batches(examples, 1) == [examples]


async def test_one_update_is_exactly_on_policy(tiny_model_dir, tmp_path):
    with rl_backend(tiny_model_dir, tmp_path) as backend:
        metrics = await train_on_batch(backend, batch_of(REWARDS), grpo(), temperature=0.7,
                                       old_from_rollout=False, reference=None)  # fmt: skip
    assert metrics["n_updates"] == 1
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert metrics["kl_to_old"] == 0.0 and metrics["clip_fraction"] == 0.0


@pytest.mark.parametrize(
    "algo", [grpo(), dapo(max_response_len=8), reinforce()], ids=lambda a: a.name
)
async def test_later_updates_see_the_policy_move_and_the_step_counts_once(
    tiny_model_dir, tmp_path, algo
):
    with rl_backend(tiny_model_dir, tmp_path) as backend:
        lr_before = backend.scheduler.get_last_lr()[0]
        metrics = await train_on_batch(backend, batch_of(REWARDS), algo, temperature=1.0,
                                       old_from_rollout=False, reference=None,
                                       mini_batches=4, epochs=2)  # fmt: skip
        assert (backend.step, backend.weight_version) == (1, 1)
        assert backend.scheduler.last_epoch == 1 and metrics["lr"] == lr_before
    assert metrics["n_updates"] == 8
    assert metrics["n_samples"] == 2 * 16  # every sample, twice
    assert metrics["kl_to_old_last"] > 0  # the 8th update is 7 updates away from the old policy
    if algo.loss == "pg":
        assert metrics["pg_is_weight_mean"] != 1.0
    else:
        assert metrics["ratio_max"] > 1.0 > metrics["ratio_min"]
        assert metrics["clip_fraction"] > 0  # lr 1e-3 moves the tiny model past the clip


def test_mini_batches_cannot_exceed_the_groups_of_a_batch():
    with pytest.raises(ConfigError, match="mini_batches"):
        load_config(RLRunConfig, "configs/rl_tiny.yaml", ["train.mini_batches=17"])
    config = load_config(RLRunConfig, "configs/rl_tiny.yaml", ["train.mini_batches=4"])
    assert (config.train.mini_batches, config.train.epochs) == (4, 1)
