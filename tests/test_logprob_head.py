"""The fused, chunked logprob head (training/data/logprob_head.py) gives the logprobs, entropies
and gradients of a full fp32 log-softmax over the vocabulary (written here, independently), and
never makes a [tokens × vocab] fp32 tensor.

Checked: the head alone; inside the model (packed and prompt-shared rows, tied and untied
embeddings, LoRA); through the backend for SFT and each RL loss, and for compute_logprobs; at
world 1 and 2 (the `distributed_grads` runs, which use the head, against a reference run here).
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from rl_helpers import batch_of, rl_backend
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from vocab_rows import VocabRows

from tests.distributed_launch import GRAD_MODES
from training.data.logprob_head import chunked_logprobs, forward_scores
from training.data.packing import forward_logits, prepare_sft_batch
from training.data.scores import TokenScores
from training.data.tokenize import TokenizedSample
from training.rl.algorithm_config import cispo, dapo, dr_grpo, gspo, reinforce_pp, rloo
from training.rl.algorithms import grpo, online_dpo, ppo
from training.rl.batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn

# --- the independent reference: a full log-softmax in fp64 --------------------------------------


def full_softmax_scores(logits_BTV: torch.Tensor, target_ids: torch.Tensor,
                        temperature: float = 1.0) -> TokenScores:  # fmt: skip
    t = 1.0 if temperature in (0.0, 1.0) else temperature
    logp_BTV = torch.log_softmax(logits_BTV.double() / t, dim=-1)
    valid = target_ids != -100
    picked = logp_BTV.gather(-1, target_ids.clamp(min=0)[..., None])[..., 0]
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(dim=-1)
    return TokenScores(
        picked.masked_fill(~valid, 0).float(), entropy_BT.masked_fill(~valid, 0).float()
    )


@dataclass(frozen=True)
class ViaFullSoftmax:
    """`loss` fed from logits through `full_softmax_scores` (not a ReadsScores: the backend
    hands it [B, T, V] logits, so the head is not used)."""

    loss: Any

    def __call__(self, logits, batch):
        scores = full_softmax_scores(logits, batch.target_ids, self.loss.temperature)
        return self.loss(scores, batch)


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return bool((a - b).abs().max() <= rel * b.abs().max().clamp_min(1e-12))


# --- the head alone ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_head_equals_a_full_log_softmax_in_value_and_gradient(dtype, temperature, chunk):
    torch.manual_seed(0)
    n, h, v = 11, 6, 37
    hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
    layer = torch.nn.Linear(h, v, dtype=dtype)
    targets = torch.randint(0, v, (n,))
    a, b = torch.randn(n, dtype=torch.float32), torch.randn(n, dtype=torch.float32)

    lp, ent = chunked_logprobs(hidden, layer, targets, temperature=temperature, entropy=True,
                               chunk_tokens=chunk)  # fmt: skip
    ((a * lp).sum() + (b * ent).sum()).backward()
    got = [hidden.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]
    for x in (hidden, layer.weight, layer.bias):
        x.grad = None
    ref = full_softmax_scores(layer(hidden)[None], targets[None], temperature)
    ((a * ref.logprobs_BT[0]).sum() + (b * ref.entropy_BT[0]).sum()).backward()
    want = [hidden.grad, layer.weight.grad, layer.bias.grad]

    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert close(lp, ref.logprobs_BT[0], 1e-6) and close(ent, ref.entropy_BT[0], 1e-6)
    for g, w in zip(got, want, strict=True):
        assert close(g, w, 1e-5)


# --- inside the model ----------------------------------------------------------------------------


def qwen2(*, tied: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=tied, attn_implementation="sdpa")  # fmt: skip
    return Qwen2ForCausalLM(config).float()


def sft_batch():
    samples = [TokenizedSample(tuple(3 + (7 * i + 5 * k) % 290 for k in range(n)),
                               (0, 0) + (1,) * (n - 2), f"s{i}")
               for i, n in enumerate((9, 4, 13, 6, 7, 11))]  # fmt: skip
    return prepare_sft_batch(samples, pad_id=0, max_tokens_per_row=20)


def shared_batch():
    batch = batch_of(
        [[1.0, 0.0, 0.5], [0.0, 1.0, 0.2]], n_response=lambda g, i: 3 + (g + 2 * i) % 4
    )
    return collate_rl(build_examples(batch, grpo()), pad_id=0)


def _scores_and_grads(model, batch, temperature, use_head):
    model.zero_grad()
    if use_head:
        scores = forward_scores(model, batch, temperature=temperature, entropy=True,
                                chunk_tokens=5)  # fmt: skip
    else:
        scores = full_softmax_scores(forward_logits(model, batch), batch.target_ids, temperature)
    g = torch.Generator().manual_seed(2)
    a = torch.randn(scores.logprobs_BT.shape, generator=g)
    (a * scores.logprobs_BT + a.flip(0) * scores.entropy_BT).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return scores, grads


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("rows", ["packed", "prompt-shared"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_in_the_model_equals_a_full_log_softmax(tied, rows, temperature):
    model = qwen2(tied=tied)
    batch = sft_batch() if rows == "packed" else shared_batch()
    assert batch.is_packed if rows == "packed" else batch.source_index is not None
    got, got_grads = _scores_and_grads(model, batch, temperature, use_head=True)
    want, want_grads = _scores_and_grads(model, batch, temperature, use_head=False)
    assert close(got.logprobs_BT, want.logprobs_BT, 1e-6)
    assert close(got.entropy_BT, want.entropy_BT, 1e-6)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, g in got_grads.items():
        assert close(g, want_grads[name]), name
    assert model.get_output_embeddings() is model.lm_head and type(model.lm_head) is torch.nn.Linear


def test_head_with_lora_equals_a_full_log_softmax():
    from training.backend.lora import wrap_with_lora
    from training.config import LoraSettings

    model = wrap_with_lora(qwen2(tied=True), LoraSettings(rank=4))
    with torch.no_grad():  # B ≠ 0, so that A's gradient is not 0 either
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = shared_batch()
    got, got_grads = _scores_and_grads(model, batch, 0.7, use_head=True)
    want, want_grads = _scores_and_grads(model, batch, 0.7, use_head=False)
    assert close(got.logprobs_BT, want.logprobs_BT, 1e-6)
    assert got_grads.keys() == want_grads.keys() and all("lora_" in n for n in got_grads)
    for name, g in got_grads.items():
        assert close(g, want_grads[name]), name


def test_head_in_bf16_equals_the_logits_path_it_replaces():
    """In half precision both compute the logits with the same bf16 matmul and upcast them for
    the statistics: the logprobs agree to fp32 rounding, the gradients to bf16 rounding."""
    from training.data.packing import token_logprobs

    model = qwen2(tied=True).bfloat16()
    batch = sft_batch()
    a = torch.randn(batch.target_ids.shape, generator=torch.Generator().manual_seed(3))
    results = []
    for use_head in (True, False):
        model.zero_grad()
        if use_head:
            logprobs_BT = forward_scores(model, batch, chunk_tokens=5).logprobs_BT
        else:
            logprobs_BT = token_logprobs(forward_logits(model, batch), batch.target_ids)
        (a * logprobs_BT).sum().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters()}
        results.append((logprobs_BT.detach(), grads))
    (head, head_grads), (old, old_grads) = results
    assert head.dtype == old.dtype == torch.float32
    assert close(head, old, 1e-6)
    for name, g in head_grads.items():
        assert close(g, old_grads[name], 2e-2), name


# --- through the backend: SFT, every RL loss, compute_logprobs -----------------------------------


async def _grads_and_metrics(backend, samples, loss_fn, weight_fn):
    await backend.call(lambda: backend.model.zero_grad(set_to_none=True)).result()
    metrics = await backend.forward_backward(samples, loss_fn=loss_fn,
                                             loss_weight_fn=weight_fn).result()  # fmt: skip
    return await backend.full_grads().result(), metrics


def _assert_same_step(got, want, keys=("loss",)):
    (got_grads, got_metrics), (want_grads, want_metrics) = got, want
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, g in got_grads.items():
        assert close(g, want_grads[name]), name
    for key in keys:
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), key


async def test_sft_step_through_the_head_equals_a_full_log_softmax(tiny_model_dir, tmp_path):
    from test_backend import make_backend

    from training.backend.pytorch import load_tokenizer, trained_tokens
    from training.data.packing import sft_loss
    from training.data.tokenize import tokenize_conversation

    tok = load_tokenizer(tiny_model_dir)
    samples = [tokenize_conversation(tok, [{"role": "user", "content": f"{i} + {i * 7} ="},
                                           {"role": "assistant", "content": f"{i * 8}" * (i % 3 + 1)}],
                                     source=f"s{i}") for i in range(9)]  # fmt: skip
    with make_backend(tiny_model_dir, tmp_path, pack_length=64, micro_batch_tokens=128) as backend:
        backend.logprob_chunk_tokens = 7
        got = await _grads_and_metrics(backend, samples, sft_loss, trained_tokens)
        want = await _grads_and_metrics(backend, samples, ViaFullSoftmax(sft_loss), trained_tokens)
    assert got[1]["n_microbatches"] > 1
    _assert_same_step(got, want, keys=("loss", "loss_sum"))


def _with_ref_and_ppo_fields(examples):
    """Reference logprobs, old logprobs and per-token advantages on every example (made up,
    deterministic): what the KL loss, several updates and PPO's GAE advantages bring."""
    out = []
    for k, e in enumerate(examples):
        n = e.n_trained
        out.append(replace(e, ref_logprobs=tuple(-1.0 - 0.1 * ((k + j) % 5) for j in range(n)),
                           old_logprobs=tuple(-1.2 - 0.05 * ((k * j) % 7) for j in range(n)),
                           token_advantages=tuple(0.3 * ((k + 2 * j) % 5 - 2) for j in range(n))))  # fmt: skip
    return out


RL_CASES = {
    "grpo": (grpo(), 1.0),
    "grpo-seq-mean-tempered": (grpo(aggregation="seq-mean-token-mean"), 0.7),
    "ppo-token-advantages": (ppo(), 1.0),
    "online-dpo": (online_dpo(), 1.0),
    "kl-loss": (grpo(kl_coef=0.1), 0.7),
    "entropy": (grpo(entropy_coef=0.05), 0.7),
}


@pytest.mark.parametrize("case", list(RL_CASES))
async def test_rl_loss_through_the_head_equals_a_full_log_softmax(tiny_model_dir, tmp_path, case):
    algorithm, temperature = RL_CASES[case]
    rewards = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2], [0.3, 0.9, 0.0, 1.0]]
    batch = batch_of(rewards, n_response=lambda g, i: 3 + (g * 5 + i * 3) % 7)
    examples = _with_ref_and_ppo_fields(build_examples(batch, algorithm))
    loss = rl_loss_fn(algorithm, temperature=temperature)
    assert loss.wants_entropy == (case == "entropy")
    with rl_backend(tiny_model_dir, tmp_path, micro_batch_tokens=40) as backend:
        backend.logprob_chunk_tokens = 5
        got = await _grads_and_metrics(backend, examples, loss, loss_weight_fn(algorithm))
        want = await _grads_and_metrics(backend, examples, ViaFullSoftmax(loss),
                                        loss_weight_fn(algorithm))  # fmt: skip
    assert got[1]["n_microbatches"] > 1
    keys = ["loss"] + [k for k in ("kl", "entropy", "preference_accuracy") if k in want[1]]
    _assert_same_step(got, want, keys=tuple(keys))


async def test_compute_logprobs_through_the_head_equals_a_full_log_softmax(
    tiny_model_dir, tmp_path
):
    """Reference and old logprobs (KL as a loss or as a reward, several updates) on
    prompt-shared rows, at a sampling temperature."""
    batch = batch_of(
        [[1.0, 0.0, 0.5], [0.0, 1.0, 0.2]], n_response=lambda g, i: 2 + (g + 3 * i) % 5
    )
    examples = build_examples(batch, grpo())
    with rl_backend(tiny_model_dir, tmp_path, micro_batch_tokens=64) as backend:
        backend.logprob_chunk_tokens = 3
        got = await backend.compute_logprobs(examples, temperature=0.7).result()

        def reference():
            with torch.no_grad():
                rows = collate_rl(examples, pad_id=backend.pad_id)
                scores = full_softmax_scores(forward_logits(backend.model, rows),
                                             rows.target_ids, 0.7)  # fmt: skip
                trained = rows.target_ids != -100
                return [scores.logprobs_BT[i][trained[i]] for i in range(len(examples))]

        want = await backend.call(reference).result()
    assert len(got) == len(examples) and all(
        len(g) == e.n_trained for g, e in zip(got, examples, strict=True)
    )
    for g, w in zip(got, want, strict=True):
        assert close(g, w, 1e-6)


# --- world 1 and 2 (the distributed_grads runs use the head) --------------------------------------


async def _reference_step(model_dir, tmp_path, mode):
    """What tests/distributed_grads.py computes for `mode`, through the full softmax."""
    import distributed_grads as dg  # the same samples and settings

    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.config import LoraSettings, OptimConfig
    from training.data.packing import sft_loss

    tok = load_tokenizer(model_dir)
    mode, tied, _ = mode.partition("-tied")
    model = dg.tie_embeddings(load_model(model_dir)) if tied else load_model(model_dir)
    mode, with_lora, _ = mode.partition("-lora")
    common = dict(optim=OptimConfig(lr=1e-3, schedule="constant"), max_steps=2,
                  checkpoint_dir=tmp_path / "ckpt", lora=LoraSettings(rank=4) if with_lora else None)  # fmt: skip
    if mode == "sft":
        backend = PyTorchTrainingBackend(model, tok, pack_length=64,
                                         micro_batch_tokens=128, **common)  # fmt: skip
        samples, loss, weight = dg.sft_samples(tok), ViaFullSoftmax(sft_loss), None
    else:
        aggregation = "token-mean" if mode == "grpo-token-mean" else "seq-mean-token-mean"
        algorithm = grpo(aggregation=aggregation)
        backend = PyTorchTrainingBackend(model, tok, pack_length=None,
                                         micro_batch_tokens=96,
                                         collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
                                         **common)  # fmt: skip
        rewards = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2], [0.3, 0.9, 0.0, 1.0]]
        batch = batch_of(rewards, n_response=lambda g, i: 3 + (g * 5 + i * 3) % 7)
        samples = build_examples(batch, algorithm)
        loss, weight = ViaFullSoftmax(rl_loss_fn(algorithm)), loss_weight_fn(algorithm)
    with backend:
        kw = {"loss_fn": loss} | ({"loss_weight_fn": weight} if weight else {})
        if with_lora:
            await backend.forward_backward(samples, **kw).result()
            await backend.optim_step().result()
        metrics = await backend.forward_backward(samples, **kw).result()
        grads = await backend.full_grads().result()
    return grads, metrics


@pytest.mark.parametrize("mode", GRAD_MODES)
async def test_head_at_world_1_and_2_equals_a_full_log_softmax(distributed_grads, tiny_model_dir,
                                                               tmp_path, mode):  # fmt: skip
    want_grads, want_metrics = await _reference_step(tiny_model_dir, tmp_path, mode)
    for world in (1, 2):
        run = distributed_grads / f"w{world}" / mode
        grads = load_file(str(run / "grads.safetensors"))
        metrics = json.loads((run / "metrics.json").read_text())
        assert grads.keys() == want_grads.keys() and len(grads) > 10
        for name, g in grads.items():
            assert close(g, want_grads[name], 1e-4 if "-lora" in mode else 1e-5), (world, name)
        assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5, abs=1e-7), world


# --- memory: no [tokens × vocab] fp32 tensor --------------------------------------------------------


async def _largest_vocab_rows(backend, samples, loss_fn, weight_fn) -> tuple[int, int]:
    vocab = backend.model.get_output_embeddings().weight.shape[0]

    def step():
        with VocabRows(vocab) as mode:
            result = backend.run_local("forward_backward", samples,
                                       {"loss_fn": loss_fn, "weight_fn": weight_fn})  # fmt: skip
        return mode.most_rows, result["n_trained_tokens"]

    return await backend.call(step).result()


async def test_no_float32_tokens_by_vocab_tensor_in_an_sft_step_or_a_grpo_update(tiny_model_dir,
                                                                                  tmp_path):  # fmt: skip
    from test_backend import make_backend

    from training.backend.pytorch import load_tokenizer, trained_tokens
    from training.data.packing import sft_loss
    from training.data.tokenize import tokenize_conversation

    chunk = 8
    tok = load_tokenizer(tiny_model_dir)
    samples = [tokenize_conversation(tok, [{"role": "user", "content": f"{i} times {i + 3}"},
                                           {"role": "assistant", "content": f"{i * (i + 3)} ok" * 3}],
                                     source=f"s{i}") for i in range(8)]  # fmt: skip
    with make_backend(
        tiny_model_dir, tmp_path, pack_length=256, micro_batch_tokens=1024
    ) as backend:
        backend.logprob_chunk_tokens = chunk
        rows, trained = await _largest_vocab_rows(backend, samples, sft_loss, trained_tokens)
    assert trained > 4 * chunk and rows <= chunk, (rows, trained)

    algorithm = grpo(entropy_coef=0.01)
    batch = batch_of([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]], n_response=lambda g, i: 9 + i)
    examples = build_examples(batch, algorithm)
    with rl_backend(tiny_model_dir, tmp_path, name="rl") as backend:
        backend.logprob_chunk_tokens = chunk
        rows, trained = await _largest_vocab_rows(
            backend, examples, rl_loss_fn(algorithm, temperature=0.7), loss_weight_fn(algorithm)
        )
    assert trained > 4 * chunk and rows <= chunk, (rows, trained)


# --- host syncs: none inside an op's micro-batches ---------------------------------------------------

SYNC_OPS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.is_nonzero.default",
    "aten.masked_select.default",
    "aten.unique_consecutive.default",
    "aten._unique2.default",
}
# indexing with a boolean mask: the kernel finds the True positions (nonzero) inside, below the
# dispatcher's Python key, so only the op and its mask's dtype show it
MASK_INDEX_OPS = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default",
                  "aten._index_put_impl_.default"}  # fmt: skip


def makes_host_wait(func, args, kwargs) -> bool:
    """Whether the op reads a value of the device on the host (on CUDA: a stream sync)."""
    name = str(func)
    if name in SYNC_OPS:
        return True
    if name == "aten.repeat_interleave.Tensor":  # the output size, unless given
        return (kwargs or {}).get("output_size") is None
    if name in MASK_INDEX_OPS and len(args) > 1:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


class DeviceReads(TorchDispatchMode):
    """Records the ops that make the host wait for the device (`.item()`, `bool(t)`, boolean
    indexing), except while a batch is built on the host (before it is copied to the device)
    and transformers' own check for packed rows in its mask construction (masking_utils; the
    attention work of issue 43 removes it)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if makes_host_wait(func, args, kwargs):
            stack = traceback.extract_stack()
            host = any(f.name in ("prepare_sft_batch", "collate_rl") for f in stack)
            if not host and not any("transformers/masking_utils" in f.filename for f in stack):
                ours = [f for f in stack if "site-packages" not in f.filename][-2]
                self.reads.append(f"{func} at {ours.filename}:{ours.lineno}")
        return func(*args, **(kwargs or {}))


async def _device_reads(backend, samples, loss_fn, weight_fn) -> tuple[list[str], int]:
    def step():
        with DeviceReads() as mode:
            result = backend.run_local("forward_backward", samples,
                                       {"loss_fn": loss_fn, "weight_fn": weight_fn})  # fmt: skip
        return mode.reads, result["n_microbatches"]

    return await backend.call(step).result()


async def test_forward_backward_reads_no_value_from_the_device_inside_its_micro_batches(
    tiny_model_dir, tmp_path
):
    """SFT and a GRPO update (KL loss, entropy bonus) keep their metrics on the device; the
    backend reads them in one transfer after the op's last pass (`read_metrics_once`)."""
    from test_backend import make_backend

    from training.backend.pytorch import load_tokenizer, trained_tokens
    from training.data.packing import sft_loss
    from training.data.tokenize import tokenize_conversation

    tok = load_tokenizer(tiny_model_dir)
    samples = [tokenize_conversation(tok, [{"role": "user", "content": f"{i} + 1"},
                                           {"role": "assistant", "content": f"{i + 1}"}],
                                     source=f"s{i}") for i in range(8)]  # fmt: skip
    with make_backend(tiny_model_dir, tmp_path, pack_length=32, micro_batch_tokens=64) as backend:
        reads, n_mb = await _device_reads(backend, samples, sft_loss, trained_tokens)
    assert n_mb > 1 and reads == [], "\n".join(reads)

    algorithm = grpo(kl_coef=0.1, entropy_coef=0.01)
    batch = batch_of([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]], n_response=lambda g, i: 5 + i)
    examples = _with_ref_and_ppo_fields(build_examples(batch, algorithm))
    with rl_backend(tiny_model_dir, tmp_path, name="rl", micro_batch_tokens=40) as backend:
        reads, _ = await _device_reads(backend, examples, rl_loss_fn(algorithm, temperature=0.7),
                                       loss_weight_fn(algorithm))  # fmt: skip
    assert reads == [], "\n".join(reads)


SYNC_FREE_CASES = {
    "online-dpo": online_dpo(),
    "dapo": dapo(max_response_len=8),
    "gspo": gspo(),
    "cispo": cispo(),
    "ppo": ppo(),
    "rloo": rloo(),
    "reinforce++": reinforce_pp(),
    "dr-grpo": dr_grpo(max_tokens_norm=16),
    **{f"mismatch-{kind}": grpo(mismatch=kind) for kind in ("tis", "mis", "icepop", "seq_tis", "seq_mis")},
}  # fmt: skip


@pytest.mark.parametrize("case", list(SYNC_FREE_CASES))
async def test_every_rl_loss_reads_no_value_from_the_device_inside_its_micro_batches(
    tiny_model_dir, tmp_path, case
):
    """Each algorithm's loss and metrics (pairs, sequence ratios, the mismatch corrections)
    stay on the device until the op's end: on a GPU a read per micro-batch waits for all of
    its queued work."""
    algorithm = SYNC_FREE_CASES[case]
    batch = batch_of([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]], n_response=lambda g, i: 5 + i)
    examples = [replace(e, rollout_logprobs=tuple(-1.05 - 0.2 * (j % 4) for j in range(e.n_trained)))
                for e in _with_ref_and_ppo_fields(build_examples(batch, algorithm))]  # fmt: skip
    with rl_backend(tiny_model_dir, tmp_path, name="rl", micro_batch_tokens=40) as backend:
        reads, _ = await _device_reads(backend, examples, rl_loss_fn(algorithm, temperature=0.7),
                                       loss_weight_fn(algorithm))  # fmt: skip
    assert reads == [], "\n".join(reads)


async def test_compute_logprobs_reads_no_value_from_the_device_inside_its_micro_batches(
    tiny_model_dir, tmp_path
):
    """Reference / old logprobs stay on the device through the op's micro-batches and come back
    in one transfer at its end: a read per micro-batch (a gather by a boolean mask, a copy to
    the host) would drain the GPU's queue at every micro-batch boundary. The values are those
    of the logits path, sample by sample."""
    from training.backend import model_io
    from training.data.logprob_head import TemperedLogprobs

    algorithm = grpo(kl_coef=0.1)
    batch = batch_of([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]], n_response=lambda g, i: 5 + i)
    examples = build_examples(batch, algorithm)
    with rl_backend(tiny_model_dir, tmp_path, name="rl", micro_batch_tokens=40) as backend:

        def logprobs():
            fn = TemperedLogprobs(0.7)
            with DeviceReads() as mode:
                got = backend.run_local("per_trained_token", examples, {"fn": fn})
            want = []  # each micro-batch's values at its trained positions, read one by one
            with torch.no_grad(), model_io.eval_mode(backend.model):
                for mb in backend.split_microbatches(examples):
                    rows = backend._collate(mb)
                    values_BT = fn(backend._forward_for(rows, fn), rows)
                    trained = rows.target_ids != -100
                    want += [values_BT[i][trained[i]].float() for i in range(len(mb))]
            return mode.reads, got, want, len(backend.split_microbatches(examples))

        reads, got, want, n_mb = await backend.call(logprobs).result()
    assert n_mb > 1 and reads == [], "\n".join(reads)
    assert [len(g) for g in got] == [e.n_trained for e in examples]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))  # bit-identical
