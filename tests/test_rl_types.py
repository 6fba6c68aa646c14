"""Record types: immutability, validation and the JSON round trip used for checkpoints/dumps."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rollouts.errors import DataError
from rollouts.types import RolloutBatch, Sample, ToolCallRecord


def make_sample(**overrides) -> Sample:
    fields = dict(
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5, 6, 7],
        loss_mask=[1, 1, 0, 1],
        rollout_logprobs=[-0.1, -0.2, 0.0, -0.4],
        response_text="calc(2+2) -> 4. answer 4",
        metadata={"answer": "4"},
        tool_calls=[
            ToolCallRecord(name="calc", arguments={"expr": "2+2"}, output="4", success=True)
        ],
        finish_reason="stop",
    )
    return Sample(**{**fields, **overrides})


def test_sequences_become_tuples_and_records_are_frozen():
    sample = make_sample()
    assert sample.response_ids == (4, 5, 6, 7)
    assert isinstance(sample.tool_calls, tuple)
    assert sample.num_trained_tokens == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.reward = 1.0  # type: ignore[misc]


def test_caller_dict_mutation_does_not_leak_into_sample():
    metadata = {"answer": "4"}
    sample = make_sample(metadata=metadata)
    metadata["answer"] = "5"
    assert sample.metadata["answer"] == "4"


def test_loss_mask_must_cover_every_response_token():
    with pytest.raises(ValueError, match="loss_mask has 3 entries for 4"):
        make_sample(loss_mask=[1, 1, 1])


def test_rollout_logprobs_are_one_per_token_or_absent():
    assert make_sample(rollout_logprobs=()).rollout_logprobs == ()
    with pytest.raises(ValueError, match="rollout_logprobs has 2 entries"):
        make_sample(rollout_logprobs=[-0.1, -0.2])


def test_unknown_status_is_rejected():
    with pytest.raises(ValueError, match="status"):
        make_sample(status="done")


def test_with_reward_replaces_reward_and_components_without_mutating():
    sample = make_sample()
    scored = sample.with_reward(1, {"correct": 1.0, "format": 0.5})
    assert (scored.reward, dict(scored.reward_components)) == (1.0, {"correct": 1.0, "format": 0.5})
    assert isinstance(scored.reward, float)
    assert sample.reward == 0.0 and sample.reward_components == {}
    assert scored.with_reward(0.3).reward_components == {}


def test_failed_marks_status_and_error_and_keeps_tokens():
    failed = make_sample().failed("reward timed out")
    assert (failed.status, failed.error) == ("failed", "reward timed out")
    assert failed.response_ids == (4, 5, 6, 7)


def test_sample_json_round_trip_is_exact():
    sample = make_sample(status="truncated", group_id=3, index_in_group=2, weight_version=7)
    sample = sample.with_reward(0.5, {"correct": 1.0, "overlong": -0.5})
    restored = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert restored == sample
    assert restored.tool_calls[0].arguments == {"expr": "2+2"}


def test_from_dict_names_unknown_and_missing_keys():
    d = make_sample().to_dict()
    with pytest.raises(DataError, match="unknown keys \\['rewrd'\\]"):
        Sample.from_dict({**d, "rewrd": 1.0})
    del d["loss_mask"]
    with pytest.raises(DataError, match="missing required keys \\['loss_mask'\\]"):
        Sample.from_dict(d)


def test_from_dict_reports_inconsistent_records_as_data_errors():
    d = make_sample().to_dict()
    d["loss_mask"] = [1]
    with pytest.raises(DataError, match="loss_mask"):
        Sample.from_dict(d)


def test_from_dict_fills_optional_defaults():
    sample = Sample.from_dict({"prompt_ids": [1], "response_ids": [2], "loss_mask": [1]})
    assert (sample.status, sample.reward, sample.rollout_logprobs) == ("completed", 0.0, ())


def test_rollout_batch_flattens_group_major_and_round_trips():
    groups = [[make_sample(group_id=g, index_in_group=i) for i in range(2)] for g in range(3)]
    batch = RolloutBatch(groups, step_id=5, epoch_id=1, metrics={"reward_mean": 0.5})
    assert [(s.group_id, s.index_in_group) for s in batch.samples] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)
    ]  # fmt: skip
    assert isinstance(batch.groups[0], tuple)
    assert RolloutBatch.from_dict(json.loads(json.dumps(batch.to_dict()))) == batch
