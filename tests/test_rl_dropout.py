"""Dropout in RL: the old-policy, reference and loss passes are the same function of the weights.

The property: with dropout configured (attention dropout in the model, LoRA dropout in the
adapters), an RL step's updates before the policy moves see a ratio of exactly 1: the loss
pass runs with every dropout probability at 0, as the eval-mode old-logprob pass does. SFT
keeps its dropout.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rl_helpers import batch_of
from training.backend.model_io import dropout_off, load_tokenizer
from training.backend.pytorch import PyTorchTrainingBackend
from training.config import LoraSettings, OptimConfig
from training.rl.algorithms import grpo
from training.rl.batch import (
    build_examples,
    collate_rl,
    loss_weight_fn,
    rl_loss_fn,
    with_old_logprobs,
)
from training.rl.step import train_on_batch

REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2], [0.3, 0.9, 0.0, 1.0], [0.1, 0.6, 0.6, 0.9]]


def policy(model_dir, tmp_path, *, lr: float) -> PyTorchTrainingBackend:
    model = AutoModelForCausalLM.from_pretrained(model_dir, attention_dropout=0.3)
    tok = load_tokenizer(model_dir)
    return PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=lr, schedule="constant", weight_decay=0.0),
        max_steps=4, checkpoint_dir=tmp_path / "ckpt", pack_length=None,
        micro_batch_tokens=64, collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip


def examples():
    return build_examples(batch_of(REWARDS, n_response=lambda g, i: 3 + (g * 5 + i * 3) % 7),
                          grpo())  # fmt: skip


async def test_with_dropout_configured_updates_before_the_policy_moves_have_ratio_exactly_1(
    tiny_model_dir, tmp_path
):
    # lr so small that no weight moves: each of the 2 mini-batch updates is a "first" update.
    backend = policy(tiny_model_dir, tmp_path, lr=1e-30)
    with backend:
        batch = batch_of(REWARDS, n_response=lambda g, i: 3 + (g * 5 + i * 3) % 7)
        metrics = await train_on_batch(backend, batch, grpo(), temperature=1.0,
                                       old_from_rollout=False, reference=None,
                                       mini_batches=2)  # fmt: skip
    assert metrics["n_updates"] == 2
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert metrics["kl_to_old"] == 0.0


async def test_the_loss_pass_with_dropout_on_differs_from_the_old_policy(tiny_model_dir, tmp_path):
    """The test above could fail: with dropout left on, the same first update's ratio is not 1."""
    backend = policy(tiny_model_dir, tmp_path, lr=1e-3)
    with backend:
        rows = examples()
        rows = with_old_logprobs(rows, await backend.compute_logprobs(rows).result())
        algorithm = grpo()
        kwargs = {"loss_fn": rl_loss_fn(algorithm), "loss_weight_fn": loss_weight_fn(algorithm)}
        on = await backend.forward_backward(rows, **kwargs).result()
        off = await backend.forward_backward(rows, **kwargs, dropout=False).result()
    assert on["ratio_max"] - on["ratio_min"] > 1e-3
    assert off["ratio_min"] == off["ratio_max"] == 1.0


def test_dropout_off_zeroes_every_dropout_and_restores_it(tiny_model_dir):
    from training.backend.lora import wrap_with_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.3)
    model = wrap_with_lora(model, LoraSettings(rank=4, dropout=0.2))
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    attention = [m for m in model.modules() if isinstance(getattr(m, "attention_dropout", None),
                                                          float)]  # fmt: skip
    assert dropouts and attention
    with dropout_off(model):
        assert all(m.p == 0.0 for m in dropouts)
        assert all(m.attention_dropout == 0.0 for m in attention)
    assert all(m.p == pytest.approx(0.2) for m in dropouts)
    assert all(m.attention_dropout == pytest.approx(0.3) for m in attention)
