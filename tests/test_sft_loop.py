"""run_sft_training end to end on the tiny model: resume equality, logging, checkpoints."""

import json

import pytest
import torch
import trio

from rollouts.tasks.arithmetic import make_problems
from training.backend.checkpoint import find_latest_checkpoint
from training.backend.pytorch import (
    PyTorchTrainingBackend,
    load_model_and_tokenizer,
    load_tokenizer,
)
from training.config import OptimConfig, SFTLoopConfig
from training.data.buffer import DataBuffer
from training.data.tokenize import tokenize_conversation
from training.loops.eval_watch import EvalWatch
from training.loops.hooks import SFTHooks
from training.loops.loggers import JsonlLogger
from training.loops.run_length import sft_run_length
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


def test_run_length_defaults_to_three_epochs_of_exact_batches():
    default = sft_run_length(SFTLoopConfig(), 300)  # neither max_steps nor epochs given
    assert default.steps == 29 and default.n_samples == 900  # 28 x 32 + 4
    assert [default.batch_at(s) for s in range(1, 30)] == [32] * 28 + [4]
    assert default.message == ("training 3 epochs = 29 steps over 300 records (batch_size 32); "
                               "set train.epochs or train.max_steps to change")  # fmt: skip
    assert default.eval_every == 2  # about ten evaluations in a run
    half = sft_run_length(SFTLoopConfig(epochs=0.5), 300)
    assert (half.steps, sum(half.batch_at(s) for s in range(1, half.steps + 1))) == (5, 150)
    steps = sft_run_length(SFTLoopConfig(max_steps=800, eval_every=200), 300)
    assert (steps.steps, steps.batch_at(800), steps.eval_every) == (800, 32, 200)
    assert "800 steps = 85.3 epochs over 300 records" in steps.message
    with pytest.raises(ValueError, match="both set the run's length"):
        SFTLoopConfig(max_steps=10, epochs=1)


async def run_epochs(model_dir, out_dir, samples, *, stop_after=None):
    """1.9 epochs of 60 samples in batches of 8 (114 samples: 15 steps, the last of 2),
    checkpointed every 5 steps; `stop_after` cancels the run after that step."""
    config = SFTLoopConfig(batch_size=8, epochs=1.9, eval_every=5, eval_samples=8,
                           checkpoint_every=5, resume="auto")  # fmt: skip
    data = SFTData(DataBuffer(samples[:60], seed=3), tuple(samples[100:108]))
    with trio.CancelScope() as scope, make_backend(model_dir, out_dir, 15) as backend:

        def stop(step, metrics):
            if step == stop_after:
                scope.cancel()

        return await run_sft_training(backend, data, config, hooks=SFTHooks(logger=stop))


async def test_an_epoch_run_resumed_mid_epoch_trains_the_same_batches(tiny_model_dir, tmp_path,
                                                                      samples):  # fmt: skip
    straight = await run_epochs(tiny_model_dir, tmp_path / "a", samples)
    assert await run_epochs(tiny_model_dir, tmp_path / "b", samples, stop_after=8) is None
    resumed = await run_epochs(tiny_model_dir, tmp_path / "b", samples)  # from step 5

    assert [m["n_samples"] for m in straight] == [8] * 14 + [2]  # 1.9 x 60 = 114, exactly
    assert len(resumed) == 10  # steps 6..15, across the epoch boundary at sample 60
    losses = [m["loss"] for m in straight[5:]]
    assert [m["loss"] for m in resumed] == pytest.approx(losses, abs=1e-6)
    state = json.loads((find_latest_checkpoint(tmp_path / "b" / "checkpoints")
                        / "trainer_state.json").read_text())  # fmt: skip
    buffer = state["extra"]["data_buffer"]
    assert (state["step"], buffer["epoch_id"], buffer["sample_offset"]) == (15, 1, 54)


async def test_overfitting_is_warned_and_keep_best_links_the_lowest_eval_loss_step(
    tiny_model_dir, tmp_path, samples, caplog
):
    config = SFTLoopConfig(batch_size=8, max_steps=8, eval_every=1, eval_samples=8,
                           checkpoint_every=100, keep_best=True, resume="never")  # fmt: skip
    # held out: the same questions answered with a word, which training on sums makes unlikely
    tokenizer = load_tokenizer(tiny_model_dir)
    zebra = [tokenize_conversation(tokenizer, [*p.sft_record()["messages"][:-1],
                                               {"role": "assistant", "content": "zebra"}])
             for p in make_problems(8, seed=7, min_digits=1, max_digits=2)]  # fmt: skip
    data = SFTData(DataBuffer(samples[:64], seed=3), tuple(zebra))
    with make_backend(tiny_model_dir, tmp_path, 8) as backend:
        backend.keep_last = 1
        history = await run_sft_training(backend, data, config)
    evals = [m["eval_loss"] for m in history]
    best_step = evals.index(min(evals)) + 1
    assert best_step < 8  # it overfits: eval loss rises after its minimum as train loss falls
    best = tmp_path / "checkpoints" / "best"
    assert best.resolve().name == f"step_{best_step:06d}" and (best / "model.safetensors").is_file()
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert kept == [f"step_{best_step:06d}", "step_000008"]  # keep_last=1, and the best

    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                and r.name == "rollouts.sft"]  # fmt: skip
    assert len(warnings) == 1 and "eval loss rose at 3 evaluations in a row" in warnings[0]
    assert f"lowest eval loss was {min(evals):.4f} at step {best_step};" in warnings[0]


def test_the_overfitting_count_survives_a_resume_and_warns_once(caplog):
    watch = EvalWatch(patience=3)
    for step, (eval_loss, train_loss) in enumerate(
        [(2.0, 3.0), (1.5, 2.5), (1.6, 2.0), (1.7, 1.8)]
    ):
        assert watch.observe(step + 1, eval_loss, train_loss) == (step + 1 <= 2)  # lowest so far
    resumed = EvalWatch()
    resumed.load_state_dict(json.loads(json.dumps(watch.state_dict())))  # as a checkpoint does
    assert not caplog.records
    resumed.observe(5, 1.8, 1.7)  # the third rise in a row, train loss still falling
    resumed.observe(6, 1.9, 1.6)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "(steps 3, 4, 5: 1.6000 → 1.7000 → 1.8000)" in warning
    assert "lowest eval loss was 1.5000 at step 2" in warning
    again = EvalWatch()
    for step, (eval_loss, train_loss) in enumerate(
        [(2.0, 3.0), (2.1, 3.1), (2.2, 2.0), (2.3, 1.9)]
    ):
        again.observe(step + 1, eval_loss, train_loss)  # the first rise came with train rising
    assert len(caplog.records) == 1
