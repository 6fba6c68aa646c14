"""RL with a LoRA policy: the reference is the policy's base model (adapters off), no copy.

Properties: the KL to that reference is exactly 0 at step 1 (LoRA's B starts at 0) and grows
once the adapter trained; online DPO's reference logprobs are the base model's; an update rule
other than `frozen` is refused before any rollout; the RL loop pushes each version as an
adapter to a real local engine, which then generates with the trained adapter's logprobs and
keeps at most `keep` versions loaded.
"""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import torch

from engines import SGLangEngine
from engines.local import open_local_engine
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.errors import ConfigError
from rollouts.manager import AsyncRolloutManager
from tests.rl_helpers import batch_of, index_reward, prompts
from training.backend.model_io import eval_mode
from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
from training.config import LoraSettings, OptimConfig, load_config
from training.data.buffer import DataBuffer
from training.loops.rl import run_rl_training
from training.recipes.rl_engines import lora_launch
from training.rl.algorithms import grpo, online_dpo
from training.rl.batch import collate_rl
from training.rl.objective import RLObjective
from training.rl.reference import BaseModelReference, ema_update, make_reference
from training.rl.step import train_on_batch
from training.rl_config import RLLoopConfig, RLRunConfig

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
                                  objective=RLObjective(grpo(kl_coef=0.1), reference=reference,
                                                        reference_update=ema_update(0.9)),
                                  export_dir=tmp_path / "w")  # fmt: skip
        assert backend.step == 0
        n_params = sum(p.numel() for p in backend.model.parameters())
    base = sum(p.numel() for p in load_model(tiny_model_dir).parameters())
    assert n_params < 1.05 * base  # one model in memory: base + adapter, no reference copy


def trainer_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under `model` (one forward pass)."""
    with torch.no_grad(), eval_mode(model):
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, :-1]
    logp = torch.log_softmax(logits.float(), -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


async def test_rl_pushes_versioned_adapters_the_engine_generates_with(tiny_model_dir, tmp_path):
    lora = LoraSettings(rank=4, keep=2)
    engine_lora = {"enable_lora": True, "max_lora_rank": 4, "lora_target_modules": ("all",)}
    rollout = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                            sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    async with (
        open_local_engine(tiny_model_dir, num_threads=1, **engine_lora) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):
        with lora_rl_backend(tiny_model_dir, tmp_path, lora=lora) as backend:
            buffer = DataBuffer(prompts(backend.tokenizer), seed=0)
            manager = AsyncRolloutManager(engine, buffer, rollout, reward_fn=index_reward,
                                          current_version=lambda: backend.weight_version)  # fmt: skip
            history = await run_rl_training(
                backend, buffer, manager, [engine], RLLoopConfig(max_steps=4),
                objective=RLObjective(grpo(kl_coef=0.05), reference=make_reference(backend)),
                export_dir=tmp_path / "weights",
            )  # fmt: skip
            prompt = list(prompts(backend.tokenizer)[0].prompt_ids)
            greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
            adapted = await engine.generate(prompt, greedy)
            base = await engine.generate(prompt, greedy, lora_path=None)
            want = await backend.call(
                lambda: trainer_logprobs(backend.model, prompt, list(adapted.output_ids))
            ).result()
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            cards = (await http.get("/v1/models")).json()["data"]
    assert [m["weight_version"] for m in history] == [1, 2, 3, 4]
    assert history[0]["kl"] == 0.0 and history[-1]["kl"] > 0
    assert engine.active_lora == "policy-v4" and adapted.weight_version == "4"
    assert sorted(c["id"] for c in cards if c.get("parent")) == ["policy-v3", "policy-v4"]
    assert max(abs(a - b) for a, b in zip(adapted.output_logprobs, want, strict=True)) < 1e-4
    assert adapted.output_logprobs != base.output_logprobs  # the adapter, not the base, served
    exported = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert exported == ["v000002", "v000003", "v000004"]
    assert not (tmp_path / "weights" / "v000004" / "model.safetensors").exists()


def test_launched_engines_get_the_lora_flags_of_model_lora():
    cfg = load_config(RLRunConfig, "configs/rl_tiny.yaml", ["model.lora.rank=16", "model.lora.keep=3",
                                                            "model.lora.target_modules=[q_proj,v_proj]"])  # fmt: skip
    assert lora_launch(cfg).args() == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
        "--max-loras-per-batch", "4",  # the 3 versions kept + the base model
    ]  # fmt: skip
    assert lora_launch(load_config(RLRunConfig, "configs/rl_tiny.yaml")) is None
