"""What a user reads when something fails inside a nursery: the cause, not "Exceptions from
Trio nursery (1 sub-exception)"; and helpers exported from `training` accept a plain string path."""

import logging

from plumbing.errors import EngineError, leaf_errors
from rollouts.manager import _abort_all
from training import find_latest_checkpoint


def test_leaf_errors_flattens_nested_groups_in_order():
    a, b, c = EngineError("a"), ValueError("b"), KeyError("c")
    group = BaseExceptionGroup("outer", [ExceptionGroup("inner", [a, b]), c])
    assert leaf_errors(group) == [a, b, c]
    assert leaf_errors(a) == [a]


async def test_a_failed_abort_all_on_shutdown_names_its_cause(caplog):
    class Engine:  # only the one method _abort_all calls; it fails as a nursery would
        async def abort_all(self):
            raise ExceptionGroup("x", [EngineError("engine http://h:1 is down: connect refused")])

    with caplog.at_level(logging.WARNING):
        await _abort_all(Engine())
    assert "EngineError: engine http://h:1 is down: connect refused" in caplog.text
    assert "sub-exception" not in caplog.text


def test_find_latest_checkpoint_accepts_a_string_path(tmp_path):
    step = tmp_path / "step_000002"
    step.mkdir()
    (step / "trainer_state.json").write_text("{}")
    (tmp_path / "latest").write_text("step_000002\n")
    assert find_latest_checkpoint(str(tmp_path)) == step
    assert find_latest_checkpoint(str(tmp_path / "nothing")) is None


def test_the_over_sampling_cap_warns_once_per_process_not_once_per_step(caplog, monkeypatch):
    # DAPO's dynamic sampling on an easy task reaches the cap at most steps: one WARNING, then
    # DEBUG, so a step line per step stays readable (the demo printed 17 of these before).
    from rollouts import generation

    monkeypatch.setattr(generation, "_cap_warned", False)
    with caplog.at_level(logging.DEBUG, logger="rollouts"):
        for accepted in (13, 10, 7):
            generation._log_cap_reached(64, accepted, 16)
    levels = [r.levelno for r in caplog.records if "over-sampling cap" in r.message]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]
