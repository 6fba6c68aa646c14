"""Small builders shared by the RL tests: a policy backend on the tiny model, scored batches, a
short real RL loop on the in-process engine (`run_loop`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import PromptItem, prompt_item
from rollouts.types import RolloutBatch, Sample
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.data.buffer import DataBuffer
from training.loops.colocate import ColocatedRollouts
from training.loops.hooks import RLHooks
from training.loops.rl import run_rl_training
from training.rl.algorithms import grpo
from training.rl.batch import collate_rl
from training.rl.objective import RLObjective
from training.rl.reference import make_reference
from training.rl_config import RLLoopConfig


def rl_backend(model_dir, tmp_path, *, micro_batch_tokens: int = 8192, name: str = "p"):
    model, tok = load_model_and_tokenizer(model_dir)
    return PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=1e-3, schedule="constant", weight_decay=0.0),
        max_steps=4, checkpoint_dir=tmp_path / name, pack_length=None,
        micro_batch_tokens=micro_batch_tokens,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip


def scored(g: int, i: int, reward: float, n_response: int = 4) -> Sample:
    response = tuple(7 + (i + k + g) % 11 for k in range(n_response))
    return Sample((5, 6, 8 + g), response, (1,) * n_response, group_id=g,
                  index_in_group=i).with_reward(reward)  # fmt: skip


def batch_of(rewards_GN: list[list[float]], n_response=lambda g, i: 4) -> RolloutBatch:
    groups = tuple(
        tuple(scored(g, i, r, n_response(g, i)) for i, r in enumerate(row))
        for g, row in enumerate(rewards_GN)
    )
    return RolloutBatch(groups, 1, 0)


async def grads_of(backend: PyTorchTrainingBackend) -> dict[str, torch.Tensor]:
    def read():
        return {
            n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None
        }

    return await backend.call(read).result()


def index_reward(sample) -> float:
    """0, 1, ... within each group: every group has a reward spread, whatever was sampled."""
    return float(sample.index_in_group)


def prompts(tokenizer, n: int = 8) -> list[PromptItem]:
    return [prompt_item(tokenizer, [{"role": "user", "content": f"{i}+{i}"}], {"answer": str(2 * i)})
            for i in range(n)]  # fmt: skip


async def run_loop(engine, model_dir: Path, tmp_path: Path, *, max_steps: int = 1,
                   checkpoint_every: int = 10, reward_fn=index_reward, algorithm=None,
                   schedule=None, with_reference: bool = False,
                   rollout: RolloutConfig | None = None, max_empty_batches: int | None = None,
                   hooks: RLHooks = RLHooks(), loop: dict[str, Any] | None = None,
                   generate_fn=None, lr: float = 1e-3, colocate: bool = False,
                   give_back=None, engines=None, **objective: Any) -> SimpleNamespace:  # fmt: skip
    """Run `run_rl_training` for `max_steps` on the in-process engine (2 prompts x 2 samples of
    at most 4 tokens by default); return its history, the policy, reference and manager.

    `objective` holds more `RLObjective` fields (advantage_fn, policy_loss_fn, kl_fn,
    reference_update, ...); `loop` more `RLLoopConfig` fields (resume, ema_decay, ...);
    `generate_fn` replaces the single-turn rollout (e.g. `with_teacher(...)`); `lr` the
    policy's constant learning rate; `give_back(backend)` the colocated trainer's memory
    give-back (`ColocatedRollouts`; the policy backend's every rank by default); `engines` the
    engines the weights are pushed to (and colocated), `[engine]` by default."""
    model, tok = load_model_and_tokenizer(model_dir)
    buffer = DataBuffer(prompts(tok), seed=0)
    backend = PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=lr, schedule="constant"), max_steps=max_steps,
        checkpoint_dir=tmp_path / "checkpoints", pack_length=None,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip
    rollout = rollout or RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                                       sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    reference = make_reference(backend) if with_reference else None
    with backend:
        extra = {} if generate_fn is None else {"generate_fn": generate_fn}
        manager = AsyncRolloutManager(engine, buffer, rollout, reward_fn=reward_fn,
                                      current_version=lambda: backend.weight_version,
                                      **extra)  # fmt: skip
        engines = list(engines or [engine])
        if colocate:  # engines.colocate: the engines rest while the trainer trains
            manager = ColocatedRollouts(manager, engines, trainer=backend,
                                        give_back=give_back and give_back(backend))  # fmt: skip
        async with contextlib.AsyncExitStack() as stack:
            if rollout.mode != "sync":  # its background generation lives in the manager's nursery
                await stack.enter_async_context(manager)
            history = await run_rl_training(
                backend, buffer, manager, engines,
                RLLoopConfig(max_steps=max_steps, checkpoint_every=checkpoint_every,
                             **({} if max_empty_batches is None else
                                {"max_empty_batches": max_empty_batches}), **(loop or {})),
                objective=RLObjective(schedule or algorithm or grpo(), reference=reference,
                                      **objective),
                export_dir=tmp_path / "weights", hooks=hooks,
            )  # fmt: skip
        if reference is not None:
            reference.close()
    return SimpleNamespace(history=history, backend=backend, reference=reference, manager=manager)


@dataclass
class Call:
    """One request a `RecordingEngine` passed on."""

    rid: str | None
    input_ids: tuple[int, ...]
    result: object


class RecordingEngine:
    """Delegates to a real engine and records each request's rid, input ids and result."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[Call] = []

    async def generate(self, input_ids, sampling_params=None, *, rid=None, **kwargs):
        result = await self.engine.generate(input_ids, sampling_params, rid=rid, **kwargs)
        self.calls.append(Call(rid, tuple(input_ids), result))
        return result

    async def abort(self, rid):
        await self.engine.abort(rid)
