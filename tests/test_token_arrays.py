"""TokenArray behaves as the tuple of its values wherever Sample/RLExample fields are used as
tuples, and a Sample holding TokenArrays is the same value as one holding tuples."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random

import numpy as np
import pytest

from rollouts.token_arrays import TokenArray, segment_sums
from rollouts.tools.rewards import count_model_turns
from rollouts.types import RolloutBatch, Sample
from rollouts.unserved import prompt_of
from training.rl.algorithm_config import grpo
from training.rl.batch import build_examples


def _cases(seed: int) -> list[tuple]:
    rng = random.Random(seed)
    out: list[tuple] = [(), (0,), (2**31 - 1, -5)]
    for _ in range(20):
        n = rng.randrange(0, 40)
        out.append(tuple(rng.randrange(-1000, 50_000) for _ in range(n)))
        out.append(tuple(float(np.float32(rng.uniform(-20, 0))) for _ in range(n)))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_a_token_array_reads_exactly_as_the_tuple_of_its_values(seed):
    rng = random.Random(seed)
    for values in _cases(seed):
        dtype = np.float32 if values and isinstance(values[0], float) else np.int32
        arr = TokenArray(values, dtype)
        assert len(arr) == len(values)
        assert arr == values and values == arr
        assert not arr != values  # noqa: SIM202 (__ne__ is the point)
        assert hash(arr) == hash(values)
        assert list(arr) == list(values) and arr.tolist() == list(values)
        assert all(type(a) is type(v) for a, v in zip(arr, values, strict=True))
        for i in range(-len(values), len(values)):
            assert arr[i] == values[i] and type(arr[i]) is type(values[i])
        for _ in range(10):
            a, b = rng.randrange(-45, 45), rng.randrange(-45, 45)
            step = rng.choice([None, 1, 2, 3, -1, -2])
            assert arr[a:b:step] == values[a:b:step]
            assert type(arr[a:b:step]) is TokenArray
        other = tuple(rng.randrange(100) for _ in range(rng.randrange(5)))
        assert arr + other == values + other and other + arr == other + values
        assert arr + TokenArray(other, np.int32) == values + other
        if values:
            v = values[rng.randrange(len(values))]
            assert v in arr and arr.count(v) == values.count(v)
            assert arr.index(v) == values.index(v)
        assert (1234567 in arr) == (1234567 in values)
        assert {arr: 1}[values] == 1 and {values: 1}[arr] == 1  # dict keys mix both
        assert pickle.loads(pickle.dumps(arr)) == values
        assert np.array_equal(np.asarray(arr), np.array(values, dtype))


def test_a_token_array_equals_no_list_as_a_tuple_does():
    arr = TokenArray([1, 2, 3])
    assert (arr == [1, 2, 3]) is ((1, 2, 3) == [1, 2, 3]) is False
    assert arr != TokenArray([1, 2]) and arr != (1, 2, 4)
    with pytest.raises(TypeError):
        _ = arr + [4]  # noqa: RUF005 (a tuple refuses a list too)


def test_a_token_array_never_changes_after_it_is_made():
    source = np.arange(5, dtype=np.int32)
    copied, viewed = TokenArray(source), TokenArray.view(source)
    source[0] = 99  # the caller keeps its array writable; the copy does not see the write
    assert copied == (0, 1, 2, 3, 4) and source.flags.writeable
    assert not viewed.array.flags.writeable and not copied.array.flags.writeable
    with pytest.raises(ValueError):
        copied.array[0] = 7
    with pytest.raises(TypeError):
        copied[0] = 7  # type: ignore[index]


def test_split_gives_views_of_each_segment_with_their_sums():
    values = np.array([1, 0, 1, 1, 0, 0, 5], dtype=np.int32)
    lengths = [2, 0, 3, 2]
    parts = TokenArray.split(values, lengths, with_sums=True)
    assert parts == [(1, 0), (), (1, 1, 0), (0, 5)]
    assert [p.sum() for p in parts] == [1, 0, 2, 5] == [sum(p) for p in parts]
    assert all(np.shares_memory(p.array, values) for p in parts if len(p))
    assert segment_sums(values, lengths).tolist() == [1, 0, 2, 5]
    assert segment_sums(values[:0], [0, 0]).tolist() == [0, 0]


def _pair() -> tuple[Sample, Sample]:
    lp = tuple(float(np.float32(-0.25 * k)) for k in range(4))
    as_tuples = Sample((3, 4, 5), (6, 7, 8, 9), (1, 0, 1, 1), lp, reward=1.0, group_id=2,
                       metadata={"answer": "7"})  # fmt: skip
    as_arrays = dataclasses.replace(
        as_tuples, prompt_ids=TokenArray([3, 4, 5], np.int32),
        response_ids=TokenArray([6, 7, 8, 9], np.int32),
        loss_mask=TokenArray([1, 0, 1, 1], np.int32), rollout_logprobs=TokenArray(lp, np.float32),
    )  # fmt: skip
    return as_tuples, as_arrays


def test_a_sample_of_token_arrays_is_the_same_value_as_one_of_tuples():
    as_tuples, as_arrays = _pair()
    assert type(as_arrays.response_ids) is TokenArray  # kept as it is, not copied to a tuple
    assert as_arrays == as_tuples and as_tuples == as_arrays
    assert as_arrays.num_trained_tokens == as_tuples.num_trained_tokens == 3
    assert as_arrays.with_reward(0.5) == as_tuples.with_reward(0.5)
    # JSON, as checkpoints (held groups), rollout dumps and worker requests write it
    text = json.dumps(as_arrays.to_dict())
    assert text == json.dumps(as_tuples.to_dict())
    assert Sample.from_dict(json.loads(text)) == as_tuples
    # a prompt's ids key the unserved-groups bookkeeping whichever form they take
    assert {as_tuples.prompt_ids: 1}[as_arrays.prompt_ids] == 1
    assert prompt_of([as_arrays]).prompt_ids == (3, 4, 5)
    assert json.loads(json.dumps(prompt_of([as_arrays]).to_dict()))["prompt_ids"] == [3, 4, 5]


def test_wrong_lengths_are_refused_for_token_arrays_as_for_tuples():
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 response tokens"):
        Sample(TokenArray([1]), TokenArray([2, 3, 4]), TokenArray([1, 1]))


def test_turns_and_trained_tokens_count_the_same_on_arrays_as_on_tuples():
    rng = random.Random(0)
    for _ in range(200):
        mask = tuple(rng.choice([0, 1, 1, 2]) for _ in range(rng.randrange(0, 12)))
        as_tuples = Sample((1,), (5,) * len(mask), mask)
        as_arrays = Sample((1,), (5,) * len(mask), TokenArray(mask, np.int32))
        assert count_model_turns(as_arrays) == count_model_turns(as_tuples)
        assert as_arrays.num_trained_tokens == as_tuples.num_trained_tokens == sum(mask)


def test_joined_and_zeros_before_give_the_tuple_result_views_or_not():
    ids = TokenArray.split(np.array([5, 6, 7, 8, 9], np.int32), [2, 3])
    assert ids[0].joined(ids[1]) == (5, 6, 7, 8, 9)  # adjacent: a view of the buffer
    assert np.shares_memory(ids[0].joined(ids[1]).array, ids[0].array)
    assert ids[1].joined(ids[0]) == (7, 8, 9, 5, 6)  # not adjacent: a copy
    masks = TokenArray.split(np.array([0, 0, 1, 1, 1, 0, 1], np.int32), [2, 2, 3], with_sums=True)
    assert masks[1].with_zeros_before(2) == (0, 0, 1, 1)  # zeros before it: a view
    assert masks[2].with_zeros_before(2) == (0, 0, 1, 0, 1)  # ones before it: not reused
    assert masks[1].with_zeros_before(3) == (0, 0, 0, 1, 1)  # fewer values before it
    assert TokenArray([1, 0], np.int32).with_zeros_before(1) == (0, 1, 0)


def test_rows_of_hand_made_token_array_samples_equal_the_tuple_rows():
    as_tuples, as_arrays = _pair()
    other = dataclasses.replace(as_tuples, reward=0.0, index_in_group=1)
    other_arrays = dataclasses.replace(as_arrays, reward=0.0, index_in_group=1)
    want = build_examples(RolloutBatch(((as_tuples, other),), 1, 0), grpo())
    got = build_examples(RolloutBatch(((as_arrays, other_arrays),), 1, 0), grpo())
    assert got == want and len(got) == 2
