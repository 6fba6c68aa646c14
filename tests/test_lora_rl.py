"""RL with a LoRA policy: the reference is the policy's base model (adapters off), no copy.

Properties: the KL to that reference is exactly 0 at step 1 (LoRA's B starts at 0) and grows
once the adapter trained; online DPO's reference logprobs are the base model's; an update rule
other than `frozen` is refused before any rollout.
"""

from __future__ import annotations

from functools import partial

import pytest

from rollouts.errors import ConfigError
from tests.rl_helpers import batch_of
from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
from training.config import LoraSettings, OptimConfig
from training.loops.rl import run_rl_training
from training.rl.algorithms import grpo, online_dpo
from training.rl.batch import collate_rl
from training.rl.reference import BaseModelReference, ema_update, make_reference
from training.rl.step import train_on_batch
from training.rl_config import RLLoopConfig

REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2], [0.3, 0.0, 1.0, 0.0], [1.0, 0.9, 0.0, 0.1]]
LORA = LoraSettings(rank=4)


def lora_rl_backend(model_dir, tmp_path, *, lora: LoraSettings | None = LORA):
    tok = load_tokenizer(model_dir)
    return PyTorchTrainingBackend(
        partial(load_model, str(model_dir)), tok,
        optim=OptimConfig(lr=1e-2, schedule="constant"), max_steps=4,
        checkpoint_dir=tmp_path / "ckpt", pack_length=None,
        collate_fn=partial(collate_rl, pad_id=tok.pad_token_id), lora=lora,
    )  # fmt: skip


async def test_kl_to_the_base_model_is_zero_at_step_one_then_grows(tiny_model_dir, tmp_path):
    with lora_rl_backend(tiny_model_dir, tmp_path) as backend:
        reference = make_reference(backend)
        assert isinstance(reference, BaseModelReference) and reference.policy is backend
        algo = grpo(kl_coef=0.1)
        kls = []
        for _ in range(3):
            metrics = await train_on_batch(backend, batch_of(REWARDS), algo, temperature=1.0,
                                           old_from_rollout=False, reference=reference)  # fmt: skip
            kls.append(metrics["kl"])
    assert kls[0] == 0.0
    assert kls[1] > 0 and kls[2] > 0


async def test_online_dpo_reference_logprobs_are_the_base_models(tiny_model_dir, tmp_path):
    """The same DPO step from a LoRA policy (B = 0) and from the plain model with a copied
    reference: the base model is the reference in both, so the losses agree."""
    batch = batch_of(REWARDS)
    losses = []
    for lora in (LoraSettings(rank=4), None):
        with lora_rl_backend(tiny_model_dir, tmp_path / str(lora is None), lora=lora) as backend:
            reference = make_reference(backend)
            metrics = await train_on_batch(backend, batch, online_dpo(), temperature=1.0,
                                           old_from_rollout=False, reference=reference)  # fmt: skip
            reference.close()
        losses.append(metrics["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


async def test_a_lora_reference_refuses_update_rules_other_than_frozen(tiny_model_dir, tmp_path):
    with lora_rl_backend(tiny_model_dir, tmp_path) as backend:
        reference = make_reference(backend)
        with pytest.raises(ConfigError, match="only the `frozen` rule"):
            await run_rl_training(backend, None, None, [], RLLoopConfig(max_steps=1),
                                  algorithm=grpo(kl_coef=0.1), export_dir=tmp_path / "w",
                                  reference=reference, reference_update=ema_update(0.9))  # fmt: skip
        assert backend.step == 0
        n_params = sum(p.numel() for p in backend.model.parameters())
    base = sum(p.numel() for p in load_model(tiny_model_dir).parameters())
    assert n_params < 1.05 * base  # one model in memory: base + adapter, no reference copy
