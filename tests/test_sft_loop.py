"""run_sft_training end to end on the tiny model: resume equality, logging, checkpoints."""

import json

import pytest
import torch

from rollouts.tasks.arithmetic import make_problems
from training.backend.checkpoint import find_latest_checkpoint
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig, SFTLoopConfig
from training.data.buffer import DataBuffer
from training.data.tokenize import tokenize_conversation
from training.loops.hooks import SFTHooks
from training.loops.loggers import JsonlLogger
from training.loops.sft import SFTData, run_sft_training


@pytest.fixture(scope="module")
def samples(tiny_tokenizer):
    problems = make_problems(120, seed=7, min_digits=1, max_digits=2)
    return [tokenize_conversation(tiny_tokenizer, p.sft_record()["messages"]) for p in problems]


def make_backend(model_dir, out_dir, max_steps):
    model, tok = load_model_and_tokenizer(model_dir)
    optim = OptimConfig(lr=2e-3, warmup_steps=3, schedule="cosine")
    return PyTorchTrainingBackend(
        model, tok, optim=optim, max_steps=max_steps, checkpoint_dir=out_dir / "checkpoints",
        micro_batch_tokens=256, pack_length=128,
    )  # fmt: skip


async def run(model_dir, out_dir, samples, *, max_steps, total_steps=20, max_wall_s=None):
    config = SFTLoopConfig(
        batch_size=8, max_steps=max_steps, eval_every=5, eval_samples=8,
        checkpoint_every=5, resume="auto", max_wall_s=max_wall_s,
    )  # fmt: skip
    data = SFTData(DataBuffer(samples[:100], seed=3), tuple(samples[100:108]))
    logger = JsonlLogger(out_dir / "metrics.jsonl")
    with make_backend(model_dir, out_dir, total_steps) as backend:
        history = await run_sft_training(backend, data, config, hooks=SFTHooks(logger=logger))
        weights = {k: v.clone() for k, v in backend.model.state_dict().items()}
    logger.close()
    return history, weights


async def test_resume_continues_loss_curve_exactly(tiny_model_dir, tmp_path, samples):
    straight, w_straight = await run(tiny_model_dir, tmp_path / "a", samples, max_steps=20)
    first, _ = await run(tiny_model_dir, tmp_path / "b", samples, max_steps=10)
    second, w_resumed = await run(tiny_model_dir, tmp_path / "b", samples, max_steps=20)

    assert len(first) == 10 and len(second) == 10
    losses = [m["loss"] for m in straight]
    assert [m["loss"] for m in first + second] == pytest.approx(losses, abs=1e-6)
    assert [m["lr"] for m in first + second] == pytest.approx([m["lr"] for m in straight])
    for k, v in w_straight.items():
        torch.testing.assert_close(w_resumed[k], v, rtol=0, atol=1e-6)
    assert losses[-1] < losses[0]  # it learns

    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 21))
    assert all("eval_loss" in r for r in lines if r["step"] % 5 == 0)
    latest = find_latest_checkpoint(tmp_path / "b" / "checkpoints")
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == 20 and state["extra"]["data_buffer"]["sample_offset"] == 60


async def test_resuming_a_finished_run_does_nothing(tiny_model_dir, tmp_path, samples):
    await run(tiny_model_dir, tmp_path, samples, max_steps=5)
    again, _ = await run(tiny_model_dir, tmp_path, samples, max_steps=5)
    assert again == []


async def test_a_wall_time_budget_ends_on_an_evaluated_checkpointed_step(tiny_model_dir, tmp_path,
                                                                         samples):  # fmt: skip
    history, _ = await run(tiny_model_dir, tmp_path, samples, max_steps=20, max_wall_s=1e-6)
    assert len(history) == 1 and "eval_loss" in history[0]  # the budget ran out in step 1
    assert find_latest_checkpoint(tmp_path / "checkpoints").name.endswith("1")
