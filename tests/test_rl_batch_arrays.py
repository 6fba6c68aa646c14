"""A batch decoded from rollout workers' frames (token fields are TokenArray views) trains exactly
as the same batch of tuples does: the same examples, the same tensors, the same loss, bit for bit.

Generated shapes: groups of unequal prompt lengths, multi-turn masks (tool tokens at 0), empty
responses, samples without logprobs, truncated samples.
"""

from __future__ import annotations

import gc
import random
import sys

import numpy as np
import pytest
import torch

from rollouts.token_arrays import TokenArray
from rollouts.types import RolloutBatch, Sample
from rollouts.workers.frames import decode_frame, decode_groups, encode_frame, encode_groups
from training.data.packing import forward_logits
from training.rl.algorithm_config import dapo, grpo, online_dpo
from training.rl.batch import build_examples, collate_rl, rl_loss_fn

TOKEN_FIELDS = ("input_ids", "loss_mask", "rollout_logprobs")


def _groups(seed: int, *, all_logprobs: bool = False) -> tuple[tuple[Sample, ...], ...]:
    rng = random.Random(seed)
    groups = []
    for g in range(rng.randrange(3, 6)):
        prompt = tuple(rng.randrange(3, 60) for _ in range(rng.randrange(1, 7)))
        group = []
        for i in range(rng.randrange(2, 5)):
            n = rng.choice([0, 1, 3, 6, 9])
            mask = tuple(rng.choice([1, 1, 1, 0]) for _ in range(n))  # 0: tool tokens
            logprobs = () if n and not all_logprobs and rng.random() < 0.2 else tuple(
                float(np.float32(rng.uniform(-6, 0))) for _ in range(n))  # fmt: skip
            group.append(Sample(prompt, tuple(rng.randrange(3, 60) for _ in range(n)), mask,
                                logprobs, reward=rng.choice([0.0, 0.5, 1.0]), group_id=g,
                                index_in_group=i, status=rng.choice(["completed"] * 3 + ["truncated"])))  # fmt: skip
        groups.append(tuple(group))
    return tuple(groups)


def _through_a_frame(groups) -> tuple[tuple[Sample, ...], ...]:
    """The groups as a trainer gets them from a rollout worker: encoded, piped, decoded."""
    records, buffers = encode_groups(groups)
    header, arrays = decode_frame(encode_frame({"groups": records}, buffers))
    return tuple(decode_groups(header["groups"], arrays))


ALGORITHMS = {"grpo": grpo(), "dapo": dapo(max_response_len=9, mask_truncated=True),
              "online_dpo": online_dpo()}  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_examples_from_a_workers_frame_equal_those_from_tuples(seed, name):
    tuples = _groups(seed)
    decoded = _through_a_frame(tuples)
    assert decoded == tuples  # the same samples, by value
    assert type(decoded[0][0].response_ids) is TokenArray  # ... held as arrays
    for share in (True, False):
        want = build_examples(RolloutBatch(tuples, 1, 0), ALGORITHMS[name], share_prompts=share)
        got = build_examples(RolloutBatch(decoded, 1, 0), ALGORITHMS[name], share_prompts=share)
        assert got == want and len(got) > 0
        for e in got:  # every token field came out as an array: the vectorised path ran
            assert all(type(getattr(e, f)) is TokenArray for f in TOKEN_FIELDS)
            assert e.n_trained == sum(e.loss_mask.tolist())
        _assert_same_tensors(collate_rl(got, pad_id=0), collate_rl(want, pad_id=0))


def _assert_same_tensors(a, b) -> None:
    for obj_a, obj_b in ((a, b), (a.base, b.base)):
        for name, value in vars(obj_a).items():
            other = getattr(obj_b, name)
            if isinstance(value, torch.Tensor):
                assert other is not None and value.dtype == other.dtype, name
                assert torch.equal(value, other), name
            elif name != "base":
                assert value == other, name


@pytest.mark.parametrize("seed", range(2))
def test_an_rl_loss_on_a_workers_frame_equals_the_loss_on_tuples(tiny_hf_model, seed):
    tuples = _groups(seed, all_logprobs=True)
    algorithm = grpo()
    losses = []
    for groups in (tuples, _through_a_frame(tuples)):
        examples = build_examples(RolloutBatch(groups, 1, 0), algorithm)
        batch = collate_rl(examples, pad_id=0)
        with torch.no_grad():
            logits = forward_logits(tiny_hf_model, batch.base)
        loss, _ = rl_loss_fn(algorithm, old_from_rollout=True)(logits, batch)
        losses.append(loss)
    assert torch.equal(losses[0], losses[1]) and torch.isfinite(losses[0])


def test_a_workers_batch_costs_the_trainer_no_python_object_per_token():
    n_samples, n_tokens = 16, 12_000
    groups = [tuple(Sample((1, 2, 3), tuple(range(n_tokens)), (1,) * n_tokens,
                           (-0.5,) * n_tokens, index_in_group=i, reward=i % 2)
                    for i in range(n_samples))]  # fmt: skip
    records, buffers = encode_groups(groups)
    header, arrays = decode_frame(encode_frame({"groups": records}, buffers))
    gc.collect()
    before = sys.getallocatedblocks()  # Python objects (numpy's token buffers are not counted)
    decoded = decode_groups(header["groups"], arrays)
    examples = build_examples(RolloutBatch(tuple(decoded), 1, 0), grpo())
    made = sys.getallocatedblocks() - before
    # one tuple of ints per field would be 12,000 objects per sample and field
    assert made < 300 * n_samples, f"{made} Python objects for {n_samples} samples"
    assert len(examples) == n_samples and examples[0].input_ids[3:] == tuple(range(n_tokens))
