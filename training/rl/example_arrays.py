"""Trainer rows of array-backed samples, built in numpy over the whole batch (pure).

A rollout worker's samples hold their tokens as `TokenArray` views of the frame they came in
(rollouts/token_arrays.py). `sample_to_example` on tuples concatenates and filters token by
token in C, but on arrays that would be a Python object per token again. Here the batch's
prompt + response ids, its loss masks (zeros over the prompt) and its trained logprobs (those
under mask != 0, as `itertools.compress` keeps them) are each built by one numpy call over all
samples, and every example gets read-only views of them: a few microseconds per sample, none
per token. The values are exactly the tuple path's (tests/test_rl_batch_arrays.py pins it).

Pure: imports numpy and the record types only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollouts.token_arrays import TokenArray, segment_sums
from rollouts.types import Sample


def all_token_arrays(samples: Sequence[Sample]) -> bool:
    """True when every sample's prompt, response, mask and logprobs are TokenArrays."""
    return bool(samples) and all(
        type(s.prompt_ids) is TokenArray
        and type(s.response_ids) is TokenArray
        and type(s.loss_mask) is TokenArray
        and type(s.rollout_logprobs) is TokenArray
        for s in samples
    )


def example_arrays(samples: Sequence[Sample]
                   ) -> tuple[list[TokenArray], list[TokenArray], list[TokenArray]]:  # fmt: skip
    """(input_ids, loss_mask, rollout_logprobs) of each array-backed sample's RLExample.

    input_ids = prompt + response; loss_mask = zeros over the prompt, then the sample's mask;
    rollout_logprobs = the logprobs of the trained tokens (mask != 0), none without logprobs.
    """
    prompts = [s.prompt_ids.array for s in samples]
    responses = [s.response_ids.array for s in samples]
    masks = [s.loss_mask.array for s in samples]
    logprobs = [s.rollout_logprobs.array for s in samples]
    ids = np.concatenate([a for pair in zip(prompts, responses, strict=True) for a in pair])
    zeros = np.zeros(max(len(p) for p in prompts), dtype=masks[0].dtype)
    mask = np.concatenate([a for p, m in zip(prompts, masks, strict=True)
                           for a in (zeros[: len(p)], m)])  # fmt: skip
    # Trained logprobs: the samples that have logprobs, under their masks' nonzero entries.
    with_lp = [i for i, lp in enumerate(logprobs) if len(lp)]
    n_trained = np.zeros(len(samples), dtype=np.int64)
    trained = np.zeros(0, dtype=np.float32)
    if with_lp:
        selected = np.concatenate([masks[i] for i in with_lp]) != 0
        trained = np.concatenate([logprobs[i] for i in with_lp])[selected]
        n_trained[with_lp] = segment_sums(selected, [len(masks[i]) for i in with_lp])
    n_rows = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    split = TokenArray.split
    return split(ids, n_rows), split(mask, n_rows), split(trained, n_trained.tolist())
