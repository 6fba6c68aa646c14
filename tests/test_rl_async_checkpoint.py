"""A checkpoint of an async-mode RL run holds every prompt the run drew and did not train (issue 49,
DESIGN.md §4: a resume neither repeats nor skips data). Real loop, in-process engine, tiny model."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from rollouts.config import RolloutConfig, SamplingConfig
from tests.rl_helpers import prompts, run_loop
from training.data.buffer import DataBuffer
from training.loops.hooks import RLHooks

STEPS = 3


async def test_each_async_checkpoint_holds_exactly_the_prompts_drawn_and_not_yet_trained(
    local_engine, tiny_model_dir, tiny_tokenizer, tmp_path
):
    """The producer draws ahead of the trainer: a collection in progress, a batch waiting in its
    channel, groups a weight push cut short that it took back from the holding area. A resume
    from step s's checkpoint starts at its cursor and serves its held groups first, so the
    prompts up to that cursor must be the ones trained by step s plus the ones held, no fewer
    (a resume would skip them) and no more (it would train them twice)."""
    _, engine = local_engine
    trained: dict[int, list[tuple[int, ...]]] = {}
    states: dict[int, dict] = {}  # each checkpoint's DataBuffer state, read as it is written

    def saved(step: int, path: Path, metrics: dict) -> None:
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
        states[step] = state["extra"]["data_buffer"]

    hooks = RLHooks(checkpoint_hook=saved, on_batch=lambda step, batch: trained.__setitem__(
        step, [g[0].prompt_ids for g in batch.groups]))  # fmt: skip
    rollout = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                            mode="async", sampling=SamplingConfig(max_new_tokens=16))  # fmt: skip
    run = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=STEPS, checkpoint_every=1,
                         rollout=rollout, hooks=hooks)  # fmt: skip
    assert [m["step"] for m in run.history] == list(range(1, STEPS + 1))
    assert all(m["groups_failed"] == 0 for m in run.history)  # no group is dropped here
    records = [p.prompt_ids for p in prompts(tiny_tokenizer)]  # run_loop's data, seed 0
    ahead = 0
    for step in range(1, STEPS + 1):
        state = states[step]
        cursor = state["epoch_id"] * len(records) + state["sample_offset"]
        drawn = Counter(DataBuffer(records, seed=0).get_prompts(cursor))
        held = Counter(tuple(h["item"]["prompt"]["prompt_ids"]) for h in state["held"])
        done = Counter(p for s in range(1, step + 1) for p in trained[s])
        assert drawn == done + held, (step, cursor, sum(done.values()), sum(held.values()))
        ahead += cursor > sum(done.values())
    assert ahead  # the producer was ahead of the trainer at some checkpoint: the case was tested
