"""Packing: rows respect capacity, targets never cross samples, and packed training is exact."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from rollouts.errors import ConfigError
from training.data.packing import (
    IGNORE_INDEX,
    forward_logits,
    pack_sequences,
    per_sample_loss,
    prepare_sft_batch,
    sft_loss,
    token_logprobs,
)
from training.data.tokenize import TokenizedSample, tokenize_conversation

PAD = 0


def toy(ids: list[int], mask: list[int], source: str = "") -> TokenizedSample:
    return TokenizedSample(input_ids=tuple(ids), loss_mask=tuple(mask), source=source)


def of_lengths(*lengths: int) -> list[TokenizedSample]:
    return [toy([7] * n, [0] + [1] * (n - 1), f"s{i}") for i, n in enumerate(lengths)]


@pytest.mark.parametrize("seed", range(5))
def test_rows_respect_capacity_and_hold_every_sample_once(seed: int):
    rng = random.Random(seed)
    samples = of_lengths(*(rng.randint(1, 50) for _ in range(rng.randint(1, 80))))
    rows = pack_sequences(samples, 64)
    assert sorted(i for row in rows for i in row) == list(range(len(samples)))
    assert all(sum(len(samples[i]) for i in row) <= 64 for row in rows)
    assert all(row == sorted(row) for row in rows)
    assert [row[0] for row in rows] == sorted(row[0] for row in rows)
    assert pack_sequences(samples, 64) == rows  # deterministic
    lower_bound = -(-sum(len(s) for s in samples) // 64)
    assert len(rows) <= lower_bound * 11 // 9 + 1  # best-fit decreasing's worst-case bound


def test_best_fit_decreasing_finds_the_tight_packing():
    # In order (greedy) this needs 4 rows of 10; sorted best-fit needs 3, all full.
    samples = of_lengths(3, 7, 4, 6, 2, 8)
    assert pack_sequences(samples, 10) == [[0, 1], [2, 3], [4, 5]]


def test_sample_longer_than_a_row_is_a_config_error():
    with pytest.raises(ConfigError, match=r"max_tokens_per_row=4 .* s1 with 5 tokens"):
        pack_sequences(of_lengths(3, 5), 4)


def test_targets_are_shifted_within_each_sample_and_never_cross_a_boundary():
    a = toy([10, 11, 12, 13], [0, 0, 1, 1])
    b = toy([20, 21, 22], [0, 1, 1])
    batch = prepare_sft_batch([a, b], pad_id=PAD, max_tokens_per_row=8)
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22]]
    assert batch.target_ids.tolist() == [[-100, 12, 13, -100, 21, 22, -100]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert batch.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1]]
    assert batch.is_packed
    assert (batch.n_samples, batch.n_trained_tokens, batch.n_tokens) == (2, 4, 7)


def test_without_packing_rows_are_right_padded_and_pads_never_targets():
    a = toy([10, 11, 12, 13], [0, 1, 1, 1])
    b = toy([20, 21], [0, 1])
    batch = prepare_sft_batch([a, b], pad_id=PAD, packing=False)
    assert batch.input_ids.tolist() == [[10, 11, 12, 13], [20, 21, PAD, PAD]]
    assert batch.target_ids.tolist() == [[11, 12, 13, -100], [21, -100, -100, -100]]
    # Pads continue the sample's positions, so the row stays one causal sequence.
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert batch.segment_ids.tolist() == [[0, 0, 0, 0], [1, 1, -1, -1]]
    assert not batch.is_packed
    assert batch.n_trained_tokens == int((batch.target_ids != IGNORE_INDEX).sum()) == 4


def test_packing_raises_padding_efficiency():
    samples = of_lengths(50, 10, 40, 20, 30, 45, 5)
    unpacked = prepare_sft_batch(samples, pad_id=PAD, packing=False)
    packed = prepare_sft_batch(samples, pad_id=PAD)
    assert unpacked.input_ids.shape == (7, 50)
    assert unpacked.padding_efficiency == pytest.approx(200 / 350)
    assert packed.input_ids.shape == (4, 50)
    assert packed.padding_efficiency == pytest.approx(200 / 200)
    assert packed.n_slots == 200
    assert packed.n_trained_tokens == unpacked.n_trained_tokens == 200 - 7


# --- the real tiny model ---------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Other processes share the 2 cores; two OpenMP threads then oversubscribe them (~7x
    slower measured), one thread does not."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tiny_model_dir) -> dict:
    """The tiny model (fp32, eval) under each attention implementation packing relies on."""
    from transformers import AutoModelForCausalLM

    return {
        impl: AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32, attn_implementation=impl
        ).eval()
        for impl in ("sdpa", "eager")
    }


@pytest.fixture
def model(models):
    return models["sdpa"]


@pytest.fixture(scope="module")
def chat_samples(tiny_tokenizer) -> list[TokenizedSample]:
    """Multi-turn conversations of varied length (about 30 to 160 tokens)."""
    rng = random.Random(0)
    samples = []
    for i in range(10):
        messages = [{"role": "system", "content": "You add numbers."}]
        for _ in range(rng.randint(1, 3)):
            a, b = rng.randrange(100), rng.randrange(100)
            question = f"what is {a}+{b} " * rng.randint(1, 3)
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"the sum is {a + b}"},
            ]
        samples.append(tokenize_conversation(tiny_tokenizer, messages, source=f"c{i}"))
    return samples


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_per_sample_loss_equals_unpacked_loss(models, impl, chat_samples):
    model = models[impl]
    packed = prepare_sft_batch(chat_samples, pad_id=PAD)
    unpacked = prepare_sft_batch(chat_samples, pad_id=PAD, packing=False)
    assert packed.input_ids.shape[0] < unpacked.input_ids.shape[0]
    assert packed.is_packed
    with torch.no_grad():
        logits_packed = forward_logits(model, packed)
        logits_unpacked = forward_logits(model, unpacked)
        alone = [per_sample_loss(forward_logits(model, single(s)), single(s)) for s in chat_samples]
    loss_packed = per_sample_loss(logits_packed, packed)
    loss_unpacked = per_sample_loss(logits_unpacked, unpacked)
    assert loss_packed.shape == (len(chat_samples),)
    torch.testing.assert_close(loss_packed, loss_unpacked, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss_unpacked, torch.cat(alone), rtol=0, atol=1e-5)
    # The batch loss is the token-mean, so it agrees too.
    mean_packed, _ = sft_loss(logits_packed, packed)
    mean_unpacked, _ = sft_loss(logits_unpacked, unpacked)
    torch.testing.assert_close(mean_packed, mean_unpacked, rtol=0, atol=1e-5)


def single(sample: TokenizedSample):
    return prepare_sft_batch([sample], pad_id=PAD)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_changing_one_packed_sample_leaves_its_row_neighbours_untouched(models, impl, chat_samples):
    model = models[impl]
    a, b = chat_samples[0], chat_samples[1]
    batch = prepare_sft_batch([a, b], pad_id=PAD, max_tokens_per_row=len(a) + len(b))
    assert batch.input_ids.shape[0] == 1
    changed_a = toy([1] + [5] * (len(a) - 1), list(a.loss_mask))
    changed = prepare_sft_batch([changed_a, b], pad_id=PAD, max_tokens_per_row=len(a) + len(b))
    with torch.no_grad():
        logits = forward_logits(model, batch)
        logits_changed = forward_logits(model, changed)
    in_b = batch.segment_ids[0] == 1
    in_a = batch.segment_ids[0] == 0
    torch.testing.assert_close(logits[0, in_b], logits_changed[0, in_b], rtol=0, atol=1e-5)
    assert (logits[0, in_a] - logits_changed[0, in_a]).abs().max() > 1e-2  # A did change


def test_padding_does_not_change_real_token_logits(model, chat_samples):
    short, long = chat_samples[0], max(chat_samples, key=len)
    assert len(short) < len(long)
    padded = prepare_sft_batch([short, long], pad_id=PAD, packing=False)
    with torch.no_grad():
        logits_padded = forward_logits(model, padded)[0, : len(short)]
        logits_alone = forward_logits(model, single(short))[0]
    torch.testing.assert_close(logits_padded, logits_alone, rtol=0, atol=1e-5)


def test_packed_training_gradients_match_unpacked(model, chat_samples):
    grads = []
    for packing in (True, False):
        batch = prepare_sft_batch(chat_samples[:6], pad_id=PAD, packing=packing)
        model.zero_grad()
        loss, metrics = sft_loss(forward_logits(model, batch), batch)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert metrics["n_trained_tokens"] == batch.n_trained_tokens
    model.zero_grad()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_forward_refuses_packed_batch_when_attention_cannot_isolate_samples():
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="my_kernel"))
    batch = prepare_sft_batch(of_lengths(3, 4), pad_id=PAD, max_tokens_per_row=7)
    assert batch.is_packed
    with pytest.raises(ConfigError, match="my_kernel"):
        forward_logits(model, batch)


@pytest.mark.parametrize("attn", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_is_refused_for_multi_row_packed_batches(attn):
    # transformers' flash path sees packed samples only in a single-row batch; in this
    # batch's two packed rows it would run one causal kernel per row, across sample boundaries.
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    batch = prepare_sft_batch(of_lengths(3, 4, 3, 4), pad_id=PAD, max_tokens_per_row=7)
    assert batch.is_packed and batch.input_ids.shape[0] == 2
    assert not _is_packed_sequence(batch.position_ids, batch_size=2)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn))
    with pytest.raises(ConfigError, match=rf"{attn}.*'eager', 'flex_attention', 'sdpa'"):
        forward_logits(model, batch)


# --- losses on synthetic logits ----------------------------------------------------------------


def test_token_logprobs_match_log_softmax_and_are_zero_off_target():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.tensor([[1, 2, -100, 4, 5], [-100, -100, 0, 10, -100]])
    expected = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    expected = expected.masked_fill(targets == -100, 0.0)
    torch.testing.assert_close(token_logprobs(logits, targets), expected)
    half = token_logprobs(logits.bfloat16(), targets)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, expected, rtol=0, atol=0.05)


def test_sft_loss_is_the_token_mean_cross_entropy_and_accumulates_exactly():
    torch.manual_seed(0)
    samples = of_lengths(6, 3, 5, 2)
    batch = prepare_sft_batch(samples, pad_id=PAD, packing=False)
    logits = torch.randn(*batch.input_ids.shape, 11, requires_grad=True)
    loss, metrics = sft_loss(logits, batch)
    expected = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch.target_ids.flatten(), ignore_index=-100
    )
    torch.testing.assert_close(loss, expected)
    assert metrics["loss"] == pytest.approx(float(expected.detach()))
    assert metrics["n_trained_tokens"] == 5 + 2 + 4 + 1

    # Micro-batches normalised by the step's trained-token count sum to the full-batch loss,
    # and their `loss_sum`s add up to the full batch's.
    parts, sums = [], []
    for rows, part in ((slice(0, 2), samples[:2]), (slice(2, 4), samples[2:])):
        micro = prepare_sft_batch(part, pad_id=PAD, packing=False)
        width = micro.input_ids.shape[1]
        micro_loss, micro_metrics = sft_loss(logits[rows, :width], micro, normalizer=12)
        parts.append(micro_loss)
        sums.append(micro_metrics["loss_sum"])
    torch.testing.assert_close(parts[0] + parts[1], expected)
    assert sum(sums) == pytest.approx(metrics["loss_sum"])
