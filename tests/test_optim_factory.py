"""A backend built with its own optimizer and LR schedule (SGD with momentum, a step schedule)
checkpoints and resumes them: the resumed run's next steps equal an uninterrupted run's."""

from __future__ import annotations

import pytest
import torch

from rollouts.tasks.arithmetic import make_problems
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.data.tokenize import tokenize_conversation


def sgd_momentum(params, optim):
    return torch.optim.SGD(params, lr=optim.lr, momentum=0.9, nesterov=True)


def halve_every_2(optimizer, optim, max_steps):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


@pytest.fixture(scope="module")
def batches(tiny_tokenizer):
    problems = make_problems(32, seed=3, min_digits=1, max_digits=3)
    samples = [tokenize_conversation(tiny_tokenizer, p.sft_record()["messages"]) for p in problems]
    return [samples[i : i + 8] for i in range(0, 32, 8)]


def make(model_dir, checkpoint_dir, **kw):
    model, tok = load_model_and_tokenizer(model_dir)
    return PyTorchTrainingBackend(model, tok, optim=OptimConfig(lr=0.05), max_steps=4,
                                  checkpoint_dir=checkpoint_dir, **kw)  # fmt: skip


async def train(backend, batches):
    lrs = []
    for batch in batches:
        await backend.forward_backward(batch).result()
        lrs.append((await backend.optim_step().result())["lr"])
    return lrs


async def test_resumed_custom_optimizer_and_schedule_continue_exactly(
    tiny_model_dir, tmp_path, batches
):
    factories = {"optimizer_factory": sgd_momentum, "scheduler_factory": halve_every_2}
    with make(tiny_model_dir, tmp_path / "straight", **factories) as straight:
        assert isinstance(straight.optimizer, torch.optim.SGD)
        lrs_straight = await train(straight, batches)
        expected = {k: v.clone() for k, v in straight.model.state_dict().items()}
    with make(tiny_model_dir, tmp_path / "cut", **factories) as first:
        lrs_cut = await train(first, batches[:2])
        await first.save_checkpoint(2, {})
    with make(tiny_model_dir, tmp_path / "cut", **factories) as resumed:
        await resumed.load_checkpoint(tmp_path / "cut")
        lrs_cut += await train(resumed, batches[2:])
        got = resumed.model.state_dict()
    assert lrs_cut == lrs_straight
    assert len(set(lrs_straight)) == 2  # the step schedule did halve the LR
    for name, value in expected.items():
        assert torch.equal(got[name], value), name  # bitwise: momentum buffers restored too


async def test_a_resume_without_the_momentum_buffers_would_differ(
    tiny_model_dir, tmp_path, batches
):
    """The property above can fail: a fresh SGD (momentum lost) lands elsewhere."""
    factories = {"optimizer_factory": sgd_momentum, "scheduler_factory": halve_every_2}
    with make(tiny_model_dir, tmp_path / "a", **factories) as straight:
        await train(straight, batches)
        expected = {k: v.clone() for k, v in straight.model.state_dict().items()}
    with make(tiny_model_dir, tmp_path / "b", **factories) as first:
        await train(first, batches[:2])
        weights = {k: v.clone() for k, v in first.model.state_dict().items()}
        schedule = first.scheduler.state_dict()
    with make(tiny_model_dir, tmp_path / "c", **factories) as fresh:
        fresh.model.load_state_dict(weights)
        fresh.scheduler.load_state_dict(schedule)  # the LR schedule in step, momentum lost
        await train(fresh, batches[2:])
        got = fresh.model.state_dict()
    assert any(not torch.equal(got[k], v) for k, v in expected.items())


def test_the_config_names_sgd_or_adamw(tiny_model_dir, tmp_path):
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    sgd = PyTorchTrainingBackend(model, tok, optim=OptimConfig(name="sgd", momentum=0.5),
                                 max_steps=2, checkpoint_dir=tmp_path)  # fmt: skip
    with sgd:
        assert isinstance(sgd.optimizer, torch.optim.SGD)
        assert sgd.optimizer.defaults["momentum"] == 0.5
    with make(tiny_model_dir, tmp_path / "d") as default:
        assert isinstance(default.optimizer, torch.optim.AdamW)
