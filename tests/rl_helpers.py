"""Small builders shared by the RL maths tests: a policy backend on the tiny model, scored batches."""

from __future__ import annotations

import torch

from rollouts.types import RolloutBatch, Sample
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.rl.batch import collate_rl


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
