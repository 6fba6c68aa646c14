"""Rollout dumps: a JSONL line per step that reads back to the same batch, errors that name the
line, and replay that trains exactly as the original step did."""

from __future__ import annotations

import pytest
import torch

from rollouts.errors import DataError
from rollouts.types import RolloutBatch, Sample, ToolCallRecord
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.loops.rl import train_on_batch
from training.rl.algorithms import grpo
from training.rl.batch import collate_rl
from training.rl.rollout_dump import RolloutDumpWriter, read_rollout_dump, replay_rollout_dump


def make_batch(step: int) -> RolloutBatch:
    tool = ToolCallRecord("calc", {"expr": "1+1"}, "2", success=True)
    groups = tuple(
        tuple(
            Sample(
                (5, 6, g),
                (7 + i, 9, 2),
                (1, 0, 1),
                (-1.0 - i, 0.0, -0.5),
                group_id=g,
                index_in_group=i,
                metadata={"answer": "2"},
                tool_calls=(tool,),
            ).with_reward(float(i), {"correct": float(i)})
            for i in range(2)
        )
        for g in range(2)
    )
    return RolloutBatch(groups, step_id=step, epoch_id=0, metrics={"reward_mean": 0.5})


def test_dump_reads_back_the_same_batches_and_the_last_line_wins(tmp_path):
    path = tmp_path / "run" / "rollouts.jsonl"
    writer = RolloutDumpWriter(path)
    writer(1, make_batch(1))
    writer(2, make_batch(2))
    writer.close()
    resumed = RolloutDumpWriter(path)  # a resumed run appends; step 2 ran again
    rerun = make_batch(3)
    resumed(2, rerun)
    resumed.close()
    batches = read_rollout_dump(path)
    assert sorted(batches) == [1, 2]
    assert batches[1] == make_batch(1)
    assert batches[2] == rerun


def test_a_malformed_dump_line_is_named(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    writer = RolloutDumpWriter(path)
    writer(1, make_batch(1))
    writer.close()
    with path.open("a") as f:
        f.write('{"step": 2, "groups": [], "step_id": 2}\n{"groups": []}\nnot json\n')
    with pytest.raises(DataError) as err:
        read_rollout_dump(path)
    message = str(err.value)
    assert "3 invalid record(s)" in message
    assert f"{path}:2: RolloutBatch record is missing required keys ['epoch_id']" in message
    assert f'{path}:3: expected an object with an integer "step"' in message
    assert f"{path}:4: invalid JSON" in message


def backend_for(model_dir, tmp_path, name: str) -> PyTorchTrainingBackend:
    model, tok = load_model_and_tokenizer(model_dir)
    return PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=1e-2, schedule="constant"), max_steps=2,
        checkpoint_dir=tmp_path / name, pack_length=None,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip


async def test_replaying_a_dumped_step_trains_exactly_like_the_original(tiny_model_dir, tmp_path):
    path = tmp_path / "rollouts.jsonl"
    writer = RolloutDumpWriter(path)
    writer(1, make_batch(1))
    writer(2, make_batch(2))
    writer.close()
    with (
        backend_for(tiny_model_dir, tmp_path, "a") as live,
        backend_for(tiny_model_dir, tmp_path, "b") as replayed,
    ):
        expected = await train_on_batch(live, make_batch(2), grpo(), temperature=1.0,
                                        old_from_rollout=False, reference=None)  # fmt: skip
        metrics = await replay_rollout_dump(replayed, path, grpo(), steps=[2])
        assert list(metrics) == [2] and replayed.step == 1
        assert metrics[2]["loss"] == expected["loss"]
        assert metrics[2]["grad_norm"] == expected["grad_norm"] > 0
        for a, b in zip(live.model.parameters(), replayed.model.parameters(), strict=True):
            assert torch.equal(a, b)
        with pytest.raises(DataError, match=r"steps \[7\] are not in the dump"):
            await replay_rollout_dump(replayed, path, grpo(), steps=[7])
