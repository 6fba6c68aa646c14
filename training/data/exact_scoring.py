"""The trainer's logprobs of one sequence run alone: what an engine in exact-logprobs mode returns.

Why alone: the trainer's logprob of a token is not a function of the token and its prefix only.
It moves with the shapes it is computed in (on CPU a matmul of 1-6 rows takes another kernel than
one of more; the attention kernel blocks its keys by the row's width), by ~1e-6 in float32,
so a token scored in a batch of others, or decoded with a KV cache, differs from the same token
scored in another batch. A sequence run alone, as a batch of one row of exactly its own tokens,
without a cache, has one computation and one result wherever it runs. The trainer scores each
sample that way in exact mode (one sample per micro-batch, no prompt sharing:
`engines.exact_logprobs` in training/rl_config.py), and the local engine calls `score_alone`
(engines/local/exact_logprobs.py), so both compute the same floats from the same weights.

What the trainer calls, in the same order: `prepare_prefix_shared_batch` (what `collate_rl`
builds for a micro-batch of one example) and `forward_scores` (the fused head: the trained
positions' hidden states, their logits upcast to float32, divided by the temperature unless it
is 0 or 1, minus their logsumexp).

Pure: imports torch only (and the trainer's data modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from training.data.logprob_head import DEFAULT_CHUNK_TOKENS, forward_scores
from training.data.packing import IGNORE_INDEX
from training.data.prefix_sharing import prepare_prefix_shared_batch


@dataclass(frozen=True)
class _Alone:
    """One sequence as the batch builders read it (`input_ids`, `loss_mask`), never shared."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    shared_prefix_len: int = 0
    unit: None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def score_alone(model: Any, prompt_ids: list[int], output_ids: list[int], *,
                temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                ) -> list[float]:  # fmt: skip
    """Logprobs of `output_ids` after `prompt_ids` under `model`, as the trainer computes them
    for that sample alone (float32; logits / `temperature`, unless it is 0 or 1).

    Args:
        model: an HF causal LM, in the dtype and on the device the caller keeps it in.
        prompt_ids: the prompt; at least one token.
        output_ids: the sampled tokens, one logprob each.

    Raises:
        ValueError: an empty prompt (no position predicts the first output token).
    """
    if not prompt_ids:
        raise ValueError("score_alone needs a prompt of at least one token")
    if not output_ids:
        return []
    ids = (*prompt_ids, *output_ids)
    sample = _Alone(ids, (0,) * len(prompt_ids) + (1,) * len(output_ids))
    device = next(model.parameters()).device
    batch = prepare_prefix_shared_batch([sample], pad_id=0).to(device)  # one row, no padding
    scores = forward_scores(model, batch, temperature=temperature, chunk_tokens=chunk_tokens)
    trained = batch.target_ids != IGNORE_INDEX
    return scores.logprobs_BT[trained].to(torch.float32).tolist()
