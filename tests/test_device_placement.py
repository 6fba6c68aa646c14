"""Device placement, checked on CPU. On CPU a tensor made on the wrong device passes every other
test; on a GPU it is a crash (the first GPU run's `index is on cpu, different from other
tensors on cuda:0`). Two checks:

- no tensor of a training step is made on the default device: an SFT step (packed rows, sdpa
  and the segment attention), a GRPO update on prompt-shared rows (both attentions, KL loss and
  entropy bonus), compute_logprobs, and the segment attention's layouts make every factory
  tensor of the training code with an explicit `device=` (tests/device_placement.py);
- the micro-batch's work runs on the `meta` device: a model and batch moved there, the fused
  head's forward and backward, the SFT loss and the RL losses on prompt-shared rows, through
  the segment attention. The meta device refuses a CPU operand the way CUDA does (`index_add():
  self, index and source expected to be in the same device`), so a tensor left on or made on
  the CPU fails here as it would on a GPU. (sdpa is left out: transformers reads a value of
  `position_ids` on the host to find packed rows, which meta tensors do not have; online DPO
  too: it selects its pairs with a boolean index.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from device_placement import DefaultDeviceFactories
from rl_helpers import batch_of

from training.backend.pytorch import PyTorchTrainingBackend, load_tokenizer, trained_tokens
from training.config import OptimConfig
from training.data.packing import prepare_sft_batch, sft_loss
from training.data.segment_attention import Segments
from training.data.tokenize import tokenize_conversation
from training.rl.algorithm_config import cispo, dapo, gspo
from training.rl.algorithms import grpo, ppo
from training.rl.batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn


def _backend(model_dir, tmp_path, attention: str, **kw) -> PyTorchTrainingBackend:
    from functools import partial

    from training.backend.model_io import load_model

    tok = load_tokenizer(model_dir)
    build = partial(load_model, str(model_dir), attention=attention)
    return PyTorchTrainingBackend(build, tok, optim=OptimConfig(lr=1e-3, schedule="constant"),
                                  max_steps=4, checkpoint_dir=tmp_path / attention, **kw)  # fmt: skip


async def _factories(backend, op: str, rows, args) -> list[str]:
    def run():
        with DefaultDeviceFactories() as mode:
            backend.run_local(op, rows, args)
        return mode.calls

    return await backend.call(run).result()


@pytest.mark.parametrize("attention", ["sdpa", "segments"])
async def test_an_sft_step_makes_no_tensor_on_the_default_device(tiny_model_dir, tmp_path,
                                                                  attention):  # fmt: skip
    tok = load_tokenizer(tiny_model_dir)
    samples = [tokenize_conversation(tok, [{"role": "user", "content": f"{i} + {i * 3} ="},
                                           {"role": "assistant", "content": f"{i * 4}" * (i % 3 + 1)}],
                                     source=f"s{i}") for i in range(8)]  # fmt: skip
    with _backend(tiny_model_dir, tmp_path, attention, pack_length=48,
                  micro_batch_tokens=96) as backend:  # fmt: skip
        calls = await _factories(backend, "forward_backward", samples,
                                 {"loss_fn": sft_loss, "weight_fn": trained_tokens})  # fmt: skip
        calls += await _factories(backend, "optim_step", None, {})
    assert calls == [], "\n".join(calls)


@pytest.mark.parametrize("attention", ["sdpa", "segments"])
async def test_a_grpo_update_on_shared_prompts_makes_no_tensor_on_the_default_device(
    tiny_model_dir, tmp_path, attention
):
    from training.data.logprob_head import TemperedLogprobs

    tok = load_tokenizer(tiny_model_dir)
    algorithm = grpo(kl_coef=0.1, entropy_coef=0.01)
    batch = batch_of([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]], n_response=lambda g, i: 5 + i)
    examples = build_examples(batch, algorithm)
    assert any(e.shared_prefix_len for e in examples)
    with _backend(tiny_model_dir, tmp_path, attention, pack_length=None, micro_batch_tokens=40,
                  collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id)) as backend:  # fmt: skip
        calls = await _factories(backend, "per_trained_token", examples,
                                 {"fn": TemperedLogprobs(1.0)})  # fmt: skip
        examples = [replace(e, ref_logprobs=(-1.0,) * e.n_trained) for e in examples]
        calls += await _factories(backend, "forward_backward", examples,
                                  {"loss_fn": rl_loss_fn(algorithm, temperature=0.7),
                                   "weight_fn": loss_weight_fn(algorithm)})  # fmt: skip
    assert calls == [], "\n".join(calls)


def test_the_segment_layouts_make_no_tensor_on_the_default_device():
    """Each kernel's layout (the CPU twin's dense mask, varlen's cu_seqlens, FlexAttention's
    block mask of a tree mask) is made on the device it is asked for."""
    batch = prepare_sft_batch([tokenize_like(n) for n in (5, 9, 3, 7)], pad_id=0,
                              max_tokens_per_row=12)  # fmt: skip
    tree = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    with DefaultDeviceFactories() as mode:
        packed = Segments(tuple(batch.input_ids.shape), batch.segment_lengths)
        packed.dense_mask(torch.device("cpu"))
        packed.cu_seqlens(torch.device("cpu"))
        Segments((2, 8), (), tree).block_mask(4)
    assert mode.calls == [], "\n".join(mode.calls)


@pytest.fixture(scope="module")
def meta_model(tiny_model_dir):
    from training.backend.model_io import load_model

    return load_model(tiny_model_dir, attention="segments").to("meta")


def _on_meta(t: torch.Tensor | None) -> bool:
    return t is None or t.device.type == "meta"


def test_batch_to_moves_every_tensor_field():
    """`SFTBatch.to` and `RLBatch.to` leave no tensor behind on the host (prompt-shared rows:
    the tree mask and source index too)."""
    from dataclasses import fields

    algorithm = grpo(kl_coef=0.1)
    examples = build_examples(batch_of([[1.0, 0.0, 0.5], [0.0, 1.0, 0.2]]), algorithm)
    examples = [replace(e, ref_logprobs=(-1.0,) * e.n_trained, old_logprobs=(-1.1,) * e.n_trained,
                        token_advantages=(0.5,) * e.n_trained) for e in examples]  # fmt: skip
    rl = collate_rl(examples, pad_id=0).to("meta")
    assert rl.source_index is not None
    for batch in (rl, rl.base):
        for f in fields(batch):
            value = getattr(batch, f.name)
            assert not isinstance(value, torch.Tensor) or _on_meta(value), f.name


def test_an_sft_micro_batch_runs_on_the_meta_device(meta_model):
    from training.data.logprob_head import forward_scores

    batch = prepare_sft_batch([tokenize_like(n) for n in (5, 9, 3, 7, 11, 4)], pad_id=0,
                              max_tokens_per_row=16).to("meta")  # fmt: skip
    assert batch.is_packed
    loss, metrics = sft_loss(forward_scores(meta_model, batch, chunk_tokens=5), batch)
    loss.backward()
    assert _on_meta(loss) and _on_meta(metrics["loss_sum"])
    assert all(_on_meta(p.grad) and p.grad is not None for p in meta_model.parameters())
    meta_model.zero_grad(set_to_none=True)


RL_CASES = {
    "grpo": (grpo(), 1.0),
    "grpo-seq-mean": (grpo(aggregation="seq-mean-token-mean"), 0.7),
    "kl-loss-entropy": (grpo(kl_coef=0.1, entropy_coef=0.05), 0.7),
    "ppo": (ppo(), 1.0),
    "dapo": (dapo(max_response_len=8), 1.0),
    "gspo": (gspo(), 1.0),
    "cispo": (cispo(), 1.0),
    "tis": (grpo(mismatch="tis"), 1.0),
    "icepop": (grpo(mismatch="icepop"), 1.0),
    "seq-mis": (grpo(mismatch="seq_mis"), 1.0),
}


@pytest.mark.parametrize("case", list(RL_CASES))
def test_an_rl_micro_batch_on_shared_prompts_runs_on_the_meta_device(meta_model, case):
    from training.data.logprob_head import forward_scores

    algorithm, temperature = RL_CASES[case]
    batch = batch_of([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]], n_response=lambda g, i: 3 + i)
    examples = [replace(e, ref_logprobs=(-1.0,) * e.n_trained, old_logprobs=(-1.1,) * e.n_trained,
                        token_advantages=(0.5,) * e.n_trained,
                        rollout_logprobs=(-1.05,) * e.n_trained)
                for e in build_examples(batch, algorithm)]  # fmt: skip
    rows = collate_rl(examples, pad_id=0).to("meta")
    assert rows.source_index is not None
    loss_fn = rl_loss_fn(algorithm, temperature=temperature)
    scores = forward_scores(meta_model, rows, temperature=temperature,
                            entropy=loss_fn.wants_entropy, chunk_tokens=5)  # fmt: skip
    loss, metrics = loss_fn(scores, rows)
    loss.backward()
    assert _on_meta(loss)
    leaves = [t for v in metrics.values() for t in (v if isinstance(v, tuple) else (v,))]  # Mean
    assert all(_on_meta(t) for t in leaves if isinstance(t, torch.Tensor))
    meta_model.zero_grad(set_to_none=True)


def test_the_logits_path_on_shared_prompts_runs_on_the_meta_device(meta_model):
    """The [B, T, V] logits path (losses that do not read `TokenScores`) maps the shared rows
    back with an index on the device too."""
    from training.data.packing import forward_logits

    algorithm = grpo(kl_coef=0.1, entropy_coef=0.05)
    batch = batch_of([[1.0, 0.0, 0.5], [0.0, 1.0, 0.2]], n_response=lambda g, i: 3 + i)
    examples = [replace(e, ref_logprobs=(-1.0,) * e.n_trained)
                for e in build_examples(batch, algorithm)]  # fmt: skip
    rows = collate_rl(examples, pad_id=0).to("meta")
    loss, _ = rl_loss_fn(algorithm, temperature=0.7)(forward_logits(meta_model, rows), rows)
    loss.backward()
    assert _on_meta(loss)
    meta_model.zero_grad(set_to_none=True)


def test_the_block_mask_is_made_on_the_tree_masks_device():
    tree = torch.ones(2, 1, 130, 130, dtype=torch.bool, device="meta").tril()
    block = Segments((2, 130), (), tree).block_mask(4)
    assert block.kv_num_blocks.device.type == "meta"


def tokenize_like(n: int):
    from training.data.tokenize import TokenizedSample

    return TokenizedSample(tuple(range(3, 3 + n)), (0,) + (1,) * (n - 1), f"n{n}")
