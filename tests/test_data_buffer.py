import pytest

from training.data.buffer import DataBuffer


def test_each_epoch_visits_every_record_once_in_seeded_order():
    buf = DataBuffer(list(range(10)), seed=3)
    first, second = buf.get_prompts(10), buf.get_prompts(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # a new permutation per epoch
    assert buf.epoch_id == 1 and buf.sample_offset == 10
    assert DataBuffer(list(range(10)), seed=3).get_prompts(10) == first
    assert DataBuffer(list(range(10)), seed=4).get_prompts(10) != first


def test_get_prompts_rolls_over_epoch_boundary_inside_one_call():
    buf = DataBuffer(list(range(5)), seed=0)
    got = buf.get_prompts(7)
    assert len(got) == 7 and buf.epoch_id == 1 and buf.sample_offset == 2
    assert sorted(got[:5]) == list(range(5))


def test_state_dict_round_trip_neither_repeats_nor_skips():
    records = list(range(23))
    straight = DataBuffer(records, seed=1)
    expected = [straight.get_prompts(4) for _ in range(12)]

    first = DataBuffer(records, seed=1)
    got = [first.get_prompts(4) for _ in range(5)]
    first.hold([{"group": 1}], weight_version=7)
    resumed = DataBuffer(records, seed=1)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.get_prompts(4) for _ in range(7)]
    assert got == expected
    assert [(h.item, h.weight_version) for h in resumed.take_held()] == [({"group": 1}, 7)]


def test_holding_area_is_fifo_and_bounded_by_max_n():
    buf = DataBuffer(["a"], seed=0)
    buf.hold(["x", "y"], weight_version=1)
    buf.hold(["z"], weight_version=2)
    assert [h.item for h in buf.take_held(2)] == ["x", "y"]
    assert buf.n_held == 1
    assert [(h.item, h.weight_version) for h in buf.take_held()] == [("z", 2)]


def test_load_state_for_other_dataset_is_refused():
    state = DataBuffer(list(range(5)), seed=0).state_dict()
    with pytest.raises(ValueError, match="5 records"):
        DataBuffer(list(range(6)), seed=0).load_state_dict(state)
