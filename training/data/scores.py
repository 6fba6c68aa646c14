"""What a loss reads instead of logits when the model runs with the fused logprob head
(training/data/logprob_head.py): the record and the marker base class.

Pure: imports torch only (types).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class TokenScores:
    """Per-token scores in the per-sample view [B, T], 0 where the target is -100: the target
    logprobs under logits / T, and the entropy of that distribution when it was asked for."""

    logprobs_BT: torch.Tensor
    entropy_BT: torch.Tensor | None = None


class ReadsScores:
    """Base of the consumers (losses, per-token readers) that read `TokenScores` instead of
    logits: the backend then runs the model with the fused head, at `temperature`, with the
    entropy when `wants_entropy`. A subclass must also accept [B, T, V] logits (direct callers,
    models whose output layer the head cannot replace), and be a module-level dataclass so
    that torchrun ranks rebuild it (training/distributed/wire.py)."""

    temperature: float = 1.0

    @property
    def wants_entropy(self) -> bool:
        return False
