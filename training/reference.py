"""Reference policy for KL and preference losses: a frozen copy of the policy, updated by rule.

The reference is a second `PyTorchTrainingBackend` over a deep copy of the policy model whose
optimizer is never stepped; it only answers `compute_logprobs` for the *same sampled tokens*
the policy trains on (never a second generation). Update rules (`ReferenceUpdateFn`, an
extension point): keep frozen, EMA toward the policy, periodic hard reset.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from training.backend import PyTorchTrainingBackend

ReferenceUpdateFn = Callable[[PyTorchTrainingBackend, PyTorchTrainingBackend, int], None]


def make_reference(policy: PyTorchTrainingBackend) -> PyTorchTrainingBackend:
    """A frozen copy of `policy`'s current model, with the same batching."""

    def frozen_copy() -> torch.nn.Module:
        model = copy.deepcopy(policy.model).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    return PyTorchTrainingBackend(
        frozen_copy, policy.tokenizer, optim=policy.optim_config, max_steps=1,
        checkpoint_dir=policy.checkpoint_dir / "reference", collate_fn=policy._collate,
        micro_batch_tokens=policy.micro_batch_tokens, pack_length=policy.pack_length,
    )  # fmt: skip


def frozen(reference: PyTorchTrainingBackend, policy: PyTorchTrainingBackend, step: int) -> None:
    """Never update the reference (the classic KL anchor)."""


def ema_update(alpha: float) -> ReferenceUpdateFn:
    """ref ← alpha·ref + (1 − alpha)·policy after every step."""

    def update(
        reference: PyTorchTrainingBackend, policy: PyTorchTrainingBackend, step: int
    ) -> None:
        with torch.no_grad():
            for r, p in zip(reference.model.parameters(), policy.model.parameters(), strict=True):
                r.mul_(alpha).add_(p.detach(), alpha=1 - alpha)

    return update


def periodic_reset(every: int) -> ReferenceUpdateFn:
    """ref ← policy every `every` steps (hard reset)."""

    def update(
        reference: PyTorchTrainingBackend, policy: PyTorchTrainingBackend, step: int
    ) -> None:
        if step % every == 0:
            reference.model.load_state_dict(policy.model.state_dict())

    return update
