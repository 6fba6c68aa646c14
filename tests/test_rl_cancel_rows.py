"""A run cancelled after a step's checkpoint (during its evaluation) still logged that step's
row: a resume from the checkpoint logs only later steps, so a missing row would never come back
(seen once as rows [1, 2, 3, 4, 5, 7] after a Ctrl-C and a resume). Real loop, in-process
engine, tiny model."""

from __future__ import annotations

import trio

from tests.rl_helpers import run_loop
from training.backend.checkpoint import find_latest_checkpoint
from training.loops.hooks import RLHooks


async def test_a_step_cancelled_during_its_evaluation_keeps_its_checkpoint_and_its_row(
    local_engine, tiny_model_dir, tmp_path
):
    _, engine = local_engine
    rows: list[int] = []
    with trio.CancelScope() as scope:

        async def cancelled_evaluation() -> dict[str, float]:
            scope.cancel()  # Ctrl-C while the step's evaluation runs
            await trio.sleep(1)
            return {"accuracy": 1.0}

        await run_loop(engine, tiny_model_dir, tmp_path, max_steps=2, checkpoint_every=2,
                       hooks=RLHooks(evaluate_fn=cancelled_evaluation,
                                     logger=lambda step, metrics: rows.append(step)))  # fmt: skip
    assert scope.cancelled_caught
    assert find_latest_checkpoint(tmp_path / "checkpoints").name == "step_000002"
    assert rows == [1, 2]
