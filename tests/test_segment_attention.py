"""The padding-free segment attention (training/data/segment_attention.py) computes today's
attention: on packed SFT rows and on prompt-shared GRPO rows, the tiny model's logits, losses
and every parameter's gradient equal the dense-mask sdpa path's (fp32); with LoRA too. Its CUDA
kernel for shared rows (FlexAttention on a block mask) runs on CPU in eager mode, so that one is
checked against the dense mask here too; the varlen kernel for packed rows needs CUDA
(benchmarks/gpu_check.py's `+segments` row checks it there), so here its calling convention is
checked against the kernel's contract run on CPU, under each signature torch has had."""

from __future__ import annotations

import random

import pytest
import torch

from training.data.packing import forward_logits, prepare_sft_batch, sft_loss
from training.data.segment_attention import SEGMENT_ATTENTION, Segments, use_segment_attention
from training.data.tokenize import TokenizedSample
from training.rl.algorithms import grpo
from training.rl.batch import build_examples, collate_rl, rl_loss_fn

PAD = 0


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(model_dir, attention: str, lora: bool = False):
    from training.backend.lora import wrap_with_lora
    from training.backend.model_io import load_model
    from training.config import LoraSettings

    torch.manual_seed(0)
    model = load_model(model_dir, attention=attention)
    if lora:
        model = wrap_with_lora(model, LoraSettings(rank=4))
        for name, p in model.named_parameters():  # B ≠ 0, so that A gets a gradient too
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    return model


def packed_samples(n: int = 9, seed: int = 0) -> list[TokenizedSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(3, 40)
        ids = tuple(rng.randrange(3, 300) for _ in range(k))
        mask = tuple(int(j >= k // 3) for j in range(k))
        out.append(TokenizedSample(ids, mask, f"s{i}"))
    return out


def run(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    logits = forward_logits(model, batch)
    loss, _ = loss_fn(logits, batch)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.item(), grads


def assert_same(a, b):
    (logits, loss, grads), (logits0, loss0, grads0) = a, b
    assert grads.keys() == grads0.keys() and len(grads0) > 5
    assert abs(loss - loss0) <= 1e-6 * abs(loss0)
    for k, g0 in grads0.items():
        err = ((grads[k] - g0).abs().max() / g0.abs().max().clamp_min(1e-12)).item()
        assert err < 1e-5, (k, err)
    return logits, logits0


@pytest.fixture(scope="module")
def tied_dir(tiny_model_dir, tmp_path_factory):
    from tests.tied_model import tied_copy

    return tied_copy(tiny_model_dir, tmp_path_factory.mktemp("tied"))


@pytest.mark.parametrize("lora", [False, True])
def test_packed_rows_give_the_dense_mask_logits_loss_and_gradients(tiny_model_dir, lora):
    batch = prepare_sft_batch(packed_samples(), pad_id=PAD, max_tokens_per_row=96)
    assert batch.is_packed and batch.input_ids.shape[0] > 1  # several packed rows, with pads
    assert (batch.segment_ids == -1).any()
    out = {attn: run(tiny(tiny_model_dir, attn, lora), batch, sft_loss)
           for attn in ("sdpa", "segments")}  # fmt: skip
    logits, logits0 = assert_same(out["segments"], out["sdpa"])
    real = batch.segment_ids >= 0
    assert (logits[real] - logits0[real]).abs().max().item() < 1e-5


def rollout_examples(seed: int):
    from rollouts.types import RolloutBatch, Sample

    rng = random.Random(seed)
    groups = []
    for g in range(3):
        prompt = tuple(rng.randrange(3, 300) for _ in range(rng.randint(4, 12)))
        group = []
        for i in range(4):
            resp = tuple(rng.randrange(3, 300) for _ in range(rng.randint(2, 9)))
            group.append(Sample(prompt, resp, (1,) * len(resp), tuple(-1.0 for _ in resp),
                                reward=float((g + i) % 2), group_id=g, index_in_group=i))  # fmt: skip
        groups.append(tuple(group))
    return build_examples(RolloutBatch(tuple(groups), 1, 0), grpo())


@pytest.mark.parametrize("lora", [False, True])
def test_prompt_shared_rows_give_the_dense_mask_logits_loss_and_gradients(tiny_model_dir, lora):
    batch = collate_rl(rollout_examples(1), pad_id=PAD)
    assert batch.attention_mask is not None  # the tree rows of prefix sharing
    out = {attn: run(tiny(tiny_model_dir, attn, lora), batch, rl_loss_fn(grpo()))
           for attn in ("sdpa", "segments")}  # fmt: skip
    logits, logits0 = assert_same(out["segments"], out["sdpa"])
    trained = batch.target_ids != -100
    assert (logits[trained] - logits0[trained]).abs().max().item() < 1e-5


@pytest.mark.parametrize("shared", [False, True])
def test_tied_embeddings_give_the_dense_mask_loss_and_gradients(tied_dir, shared):
    if shared:
        batch, loss_fn = collate_rl(rollout_examples(3), pad_id=PAD), rl_loss_fn(grpo())
    else:
        batch = prepare_sft_batch(packed_samples(seed=1), pad_id=PAD, max_tokens_per_row=96)
        loss_fn = sft_loss
    out = {attn: run(tiny(tied_dir, attn), batch, loss_fn) for attn in ("sdpa", "segments")}
    assert_same(out["segments"], out["sdpa"])


def test_segment_attention_builds_no_4d_mask_and_never_expands_kv(tiny_model_dir):
    """The point of the change: transformers' mask builder and `repeat_kv` never run."""
    from unittest import mock

    import transformers.integrations.sdpa_attention as sdpa_mod
    import transformers.masking_utils as mu

    model = tiny(tiny_model_dir, "segments")
    assert model.config._attn_implementation == SEGMENT_ATTENTION
    batch = prepare_sft_batch(packed_samples(), pad_id=PAD, max_tokens_per_row=96)
    with (mock.patch.object(sdpa_mod, "repeat_kv", side_effect=AssertionError("repeat_kv")),
          mock.patch.object(mu, "sdpa_mask", side_effect=AssertionError("a 4D mask"))):  # fmt: skip
        forward_logits(model, batch)


def test_flex_block_mask_kernel_equals_the_dense_tree_mask():
    """The CUDA kernel of shared rows, run eagerly on CPU (forward only: flex has no CPU
    backward): FlexAttention on the block mask made from the tree mask = SDPA on the dense
    mask, with GQA (4 query heads, 2 KV heads), pads included (each sees only itself)."""
    from torch.nn.attention.flex_attention import flex_attention

    batch = collate_rl(rollout_examples(2), pad_id=PAD)
    tree = batch.attention_mask
    b, _, t, _ = tree.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, 8, generator=g) for h in (4, 2, 2))
    segments = Segments((b, t), (), tree)
    flex = flex_attention(q, k, v, block_mask=segments.block_mask(4), enable_gqa=True)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=tree,
                                                             enable_gqa=True)  # fmt: skip
    assert (flex - dense).abs().max().item() < 1e-5


def test_generation_with_left_padding_is_unchanged(tiny_model_dir):
    """Generation brings its own 2D mask and no segments: the sdpa path's answers."""
    from training.backend.model_io import generate_batch, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    answers = [generate_batch(tiny(tiny_model_dir, attn), tok, prompts, 5)
               for attn in ("sdpa", "segments")]  # fmt: skip
    assert answers[0] == answers[1] and any(answers[0])


def test_sliding_window_models_are_refused_with_the_fix():
    from types import SimpleNamespace

    from plumbing.errors import ConfigError

    model = SimpleNamespace(config=SimpleNamespace(layer_types=["sliding_attention"]))
    with pytest.raises(ConfigError, match="model.attention: sdpa"):
        use_segment_attention(model)


def test_flash_attention_2_is_refused_for_packed_rows_it_would_not_isolate():
    """transformers finds packed samples from position_ids under FA2 only in a batch of one
    row; packed micro-batches have several, whose samples would attend across boundaries."""
    from types import SimpleNamespace

    from plumbing.errors import ConfigError

    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    batch = prepare_sft_batch(packed_samples(), pad_id=PAD, max_tokens_per_row=96)
    assert batch.is_packed and batch.input_ids.shape[0] > 1
    with pytest.raises(ConfigError, match="flash_attention_2"):
        forward_logits(model, batch)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale=None, gqa=False):
    """FlashAttention varlen's contract on CPU, per segment with SDPA: q [N, Hq, D], k/v
    [N, Hkv, D]; Hq != Hkv only with GQA (as the kernel of a torch without `enable_gqa`)."""
    assert gqa or k.shape[1] == q.shape[1], "this signature takes no GQA"
    assert int(cu_q[-1]) == q.shape[0] and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.empty_like(q)
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        seg = [x[s:e].transpose(0, 1) for x in (q, k, v)]
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(
            *seg, is_causal=causal, scale=scale, enable_gqa=gqa).transpose(0, 1)  # fmt: skip
    return out


def varlen_2_13(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False):  # fmt: skip
    assert window_size in ((-1, -1), (-1, 0))
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=window_size == (-1, 0),
                             scale=scale, gqa=enable_gqa)  # fmt: skip


def varlen_no_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1), k_cache=None):  # fmt: skip
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=window_size == (-1, 0),
                             scale=scale)  # fmt: skip


def varlen_is_causal(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=is_causal)


@pytest.mark.parametrize("kernel", [varlen_2_13, varlen_no_gqa, varlen_is_causal])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_varlen_attention_equals_the_dense_mask_path_under_every_torch_signature(kernel, scaling):
    """The packed rows' CUDA kernel, FlashAttention varlen, is called through whichever
    signature the installed torch has (the GPU image's torch is older than this machine's):
    causal within each sample, GQA and a non-default scale included, it computes what the
    dense-mask SDPA path computes. The kernel here is its contract run on CPU."""
    from training.data.segment_attention import VarlenKernel, _varlen

    torch.manual_seed(0)
    lengths = (5, 1, 10, 3, 6, 7)  # two rows of 16 slots, no sample across a row's end
    segments = Segments((2, 16), lengths)
    q = torch.randn(2, 4, 16, 8)
    k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=segments.dense_mask(q.device), scale=scaling, enable_gqa=True)  # fmt: skip
    from training.data import segment_attention

    adapted = VarlenKernel.of(kernel)
    saved = segment_attention._VARLEN[:]
    segment_attention._VARLEN[:] = [adapted]
    try:
        out = _varlen(q, k, v, segments, scaling)
    finally:
        segment_attention._VARLEN[:] = saved
    assert out.shape == dense.shape
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
