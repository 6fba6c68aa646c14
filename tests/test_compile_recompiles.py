"""`backend.fsdp.compile_layers` traces each decoder layer once, not once per micro-batch: packed
SFT micro-batches of other row counts, widths and sample counts, and prompt-shared GRPO rows,
through the segment attention, add no graph after the first ones. A recompile per micro-batch
would cost a compile per step (and past Dynamo's recompile limit, silently run the layers
eager). Traced with Dynamo's "eager" backend: the guards are Dynamo's, whatever the backend
(Inductor compiles for minutes on CPU, tests/test_compile_layers.py)."""

from __future__ import annotations

import random

import pytest
import torch

from training.data.logprob_head import forward_scores
from training.data.packing import prepare_sft_batch, sft_loss
from training.data.tokenize import TokenizedSample
from training.distributed.context import compile_layers, decoder_layers


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def _packed(rng: random.Random, n_samples: int, width: int):
    samples = [TokenizedSample(tuple(rng.randrange(3, 300) for _ in range(k)),
                               (0,) + (1,) * (k - 1), f"s{i}")
               for i, k in enumerate(rng.randint(width // 3, width // 2) for _ in range(n_samples))]  # fmt: skip
    return prepare_sft_batch(samples, pad_id=0, max_tokens_per_row=width)


def _graphs(counters) -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_layers_trace_once_for_micro_batches_of_any_layout(tiny_model_dir, fresh_dynamo):
    from rl_helpers import batch_of

    from training.backend.model_io import load_model
    from training.rl.algorithms import grpo
    from training.rl.batch import build_examples, collate_rl, rl_loss_fn

    model = load_model(tiny_model_dir, attention="segments")
    compile_layers(decoder_layers(model), backend="eager")
    rng = random.Random(0)

    def sft_step(batch) -> None:
        assert batch.input_ids.shape[0] > 1  # one row is a size Dynamo specialises (once)
        loss, _ = sft_loss(forward_scores(model, batch, chunk_tokens=16), batch)
        loss.backward()

    algorithm = grpo(kl_coef=0.0)
    loss_fn = rl_loss_fn(algorithm, temperature=1.0)

    def grpo_step(sizes: tuple[int, ...]) -> None:  # prompt-shared rows: the tree mask's path
        rewards = [[float(i % 2) for i in range(n)] for n in sizes]
        rows = collate_rl(
            build_examples(batch_of(rewards, lambda g, i: 3 + i), algorithm), pad_id=0
        )
        assert rows.source_index is not None and rows.input_ids.shape[0] > 1
        loss_fn(forward_scores(model, rows, chunk_tokens=16), rows)[0].backward()

    sft_step(_packed(rng, 7, 48))  # the first batch of each kind traces the layers
    grpo_step((4, 4))
    first = _graphs(fresh_dynamo)
    assert first > 0, "the layers were not compiled"
    seen = set()
    for n_samples, width in ((4, 40), (9, 64), (5, 56), (12, 80), (6, 48)):
        batch = _packed(rng, n_samples, width)
        seen.add((tuple(batch.input_ids.shape), len(batch.segment_lengths)))
        sft_step(batch)
    assert len(seen) == 5
    grpo_step((5, 5))
    grpo_step((3, 3, 3))
    recompiles = _graphs(fresh_dynamo) - first
    assert recompiles == 0, f"{recompiles} graphs traced after the first micro-batches"
