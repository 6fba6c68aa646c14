"""The SFT run an RL recipe starts from: a stop keeps its checkpoint, says so, and resumes."""

import json
import logging

import trio

from training.backend.checkpoint import checkpoint_step, find_latest_checkpoint
from training.config import SFTRunConfig, load_config
from training.recipes.rl import sft_checkpoint_mismatch
from training.recipes.sft_preamble import run_sft_preamble


async def test_a_stopped_sft_preamble_keeps_its_checkpoint_says_so_and_resumes_from_it(
    tiny_model_dir, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="rollouts")
    sft = load_config(SFTRunConfig, None, [
        f"output_dir={tmp_path / 'sft'}", f"model.path={tiny_model_dir}", "train.max_steps=8",
        "train.batch_size=4", "train.checkpoint_every=400", "train.resume=never",
        "train.eval_samples=4", "train.greedy_eval_samples=0", "backend.num_threads=1",
        f"data.task_dir={tmp_path / 'd'}", "data.arithmetic.n_sft=40", "data.arithmetic.n_rl=8",
        "data.arithmetic.n_eval=8",
    ])  # fmt: skip
    checkpoints = tmp_path / "sft" / "checkpoints"

    async def stop_after_a_checkpoint(scope: trio.CancelScope) -> None:
        with trio.fail_after(120):
            while (find_latest_checkpoint(checkpoints) is None
                   or checkpoint_step(find_latest_checkpoint(checkpoints)) < 3):  # fmt: skip
                await trio.sleep(0.05)
        scope.cancel()

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            nursery.start_soon(stop_after_a_checkpoint, scope)
            await run_sft_preamble(sft)
        nursery.cancel_scope.cancel()
    assert scope.cancelled_caught
    kept = find_latest_checkpoint(checkpoints)
    assert kept is not None and 3 <= checkpoint_step(kept) < 8  # checkpoint_every=400 aside
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"its checkpoint {kept} is kept: running the same command again resumes the SFT"
               " from it" in w for w in warnings), warnings  # fmt: skip

    caplog.clear()
    summary = await run_sft_preamble(sft)
    assert f"resuming the SFT run from {kept}" in caplog.text
    assert summary.steps == 8 and sft_checkpoint_mismatch(summary.checkpoint, sft) is None
    rows = (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == list(range(1, 9))
