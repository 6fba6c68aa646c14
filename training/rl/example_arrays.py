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

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, TypeVar

from rollouts.token_arrays import TokenArray
from rollouts.types import Sample

R = TypeVar("R")
_new = object.__new__


def frozen_record(cls: type[R], **values: Any) -> R:
    """`cls(**values)` for a frozen dataclass whose `__init__` only sets its fields (no
    `__post_init__`), without the one `object.__setattr__` call per field: ~3x cheaper, for
    the thousands of rows of a worker's batch. Fields left out take their defaults."""
    record = _new(cls)
    record.__dict__.update(_defaults(cls), **values)
    return record


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or any(f.default_factory is not dataclasses.MISSING
                                            for f in fields):  # fmt: skip
        raise TypeError(f"{cls.__name__} has a __post_init__ or a default_factory: build it "
                        f"with {cls.__name__}(...)")  # fmt: skip
    return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


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
    A frame's samples get views of it (its ids and masks are laid out as these rows are, and a
    mask with no 0 keeps every logprob); the others, copies.
    """
    out_ids, out_mask, out_lp = [], [], []
    for s in samples:
        mask, logprobs = s.loss_mask, s.rollout_logprobs
        out_ids.append(s.prompt_ids.joined(s.response_ids))
        out_mask.append(mask.with_zeros_before(len(s.prompt_ids)))
        if len(logprobs) and mask.count_nonzero() < len(mask):
            logprobs = TokenArray.view(logprobs.array[mask.array != 0])
        out_lp.append(logprobs)
    return out_ids, out_mask, out_lp
