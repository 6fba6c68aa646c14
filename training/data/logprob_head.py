"""The fused, chunked logprob head: target-token logprobs (and entropy) without [tokens × vocab]
fp32 tensors.

What it computes: for each *trained* position (target id ≠ -100) of a batch, the log-probability
of its target under logits / T, and, when a loss asks for it, the entropy of that tempered
distribution. It runs inside the model's forward, in place of the output layer, so under FSDP2
it sees the unsharded (and, with tied embeddings, shared) output weight, and its gradient
reaches that weight the way the output layer's would.

How: the hidden states of the trained positions are taken in chunks of `chunk_tokens`; each
chunk's logits [chunk, V] are computed (a matmul in the compute dtype), upcast to fp32 for the
max/logsumexp, the target gathered, and dropped. Backward recomputes each chunk's logits from the
saved hidden states and weight (one more head matmul), forms dL/dlogits for the chunk and
multiplies it out, accumulating the weight's gradient in fp32. At any time only one chunk's
logits exist: memory ≈ chunk_tokens × V × (2 bytes in bf16 + ~12 bytes of fp32 temporaries),
about 4 GiB at 2,048 tokens for a 151,936-token vocabulary, against [B, T, V] logits plus a
per-row fp32 copy on the logits path. Prompt and padding positions never reach the head.

Values equal `token_logprobs(temper_logits(logits, T), targets)` and `token_entropy` of the
logits path (tests/test_logprob_head.py checks both, and their gradients, against a full fp32
log_softmax); the one departure in half precision is that 1/T is applied after the fp32 upcast
rather than before it (one rounding less).

Not covered: an output layer that is not a plain `torch.nn.Linear` (a LoRA adapter on the head,
a value head): `uses_head` says no and callers keep the logits path.

Pure: imports torch only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from training.data.packing import (
    IGNORE_INDEX,
    SFTBatch,
    forward_logits,
    run_model,
    temper_logits,
    token_logprobs,
)
from training.data.scores import ReadsScores, TokenScores

DEFAULT_CHUNK_TOKENS = 2048  # 2k–4k tokens keep the head's matmuls large enough for a GPU


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float) -> torch.Tensor:  # fmt: skip
    z = F.linear(hidden, weight, bias).float()
    return z if temperature in (0.0, 1.0) else z / temperature


class _ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) → fp32 logprobs [N] and
    entropy [N] (empty when not asked for), chunked over tokens, recomputing in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk], weight, bias, temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk] = lse_c
            logprobs[s : s + chunk] = z.gather(1, targets[s : s + chunk, None]).squeeze(1) - lse_c
            if with_entropy:  # H = lse - Σ p z
                p = (z - lse_c[:, None]).exp_()
                entropy[s : s + chunk] = lse_c - (p * z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        scale = 1.0 if t in (0.0, 1.0) else 1.0 / t
        n = hidden.shape[0]
        if g_logprobs is None:
            g_logprobs = lse.new_zeros(n)
        use_entropy = ctx.with_entropy and g_entropy is not None
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                  if ctx.needs_input_grad[1] else None)  # fmt: skip
        grad_b = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                  if bias is not None and ctx.needs_input_grad[2] else None)  # fmt: skip
        for s in range(0, n, chunk):
            h = hidden[s : s + chunk]
            z = _chunk_logits(h, weight, bias, t)
            logp = z.sub_(lse[s : s + chunk, None])  # z is not needed after this
            p = logp.exp()
            g = g_logprobs[s : s + chunk, None]
            if use_entropy:  # dH/dz = -p (log p + H)
                g = g + g_entropy[s : s + chunk, None] * (logp + entropy[s : s + chunk, None])
            dz = p.mul_(g).neg_()  # d logp_y / dz = onehot(y) - p
            dz.scatter_add_(1, targets[s : s + chunk, None], g_logprobs[s : s + chunk, None])
            if scale != 1.0:
                dz.mul_(scale)
            del logp
            if grad_b is not None:
                grad_b += dz.sum(dim=0)
            dz = dz.to(hidden.dtype)
            if grad_h is not None:
                grad_h[s : s + chunk] = dz @ weight
            if grad_w is not None:
                grad_w += (dz.t() @ h).float()
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)  # fmt: skip


def chunked_logprobs(hidden_NH: torch.Tensor, output: torch.nn.Linear, targets_N: torch.Tensor, *,
                     temperature: float = 1.0, entropy: bool = False,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Logprobs [N] (fp32) of `targets_N` under `output(hidden_NH) / temperature`, and the
    entropy [N] when `entropy`; with gradients to the hidden states and the output layer."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1, got {chunk_tokens}")
    logprobs, ent = _ChunkedLogprobs.apply(hidden_NH, output.weight, output.bias, targets_N,
                                           temperature, chunk_tokens, entropy)  # fmt: skip
    return logprobs, (ent if entropy else None)


class LogprobHead(torch.nn.Module):
    """Stands in for the model's output layer during one forward (`forward_scores`): returns
    the logprobs of the requested positions instead of logits, reading the output layer's
    parameters at call time (under FSDP2: the unsharded ones)."""

    def __init__(self, output: torch.nn.Linear, index_N: torch.Tensor, targets_N: torch.Tensor,
                 temperature: float, entropy: bool, chunk_tokens: int):  # fmt: skip
        super().__init__()
        self.output = output
        self.index_N, self.targets_N = index_N, targets_N
        self.temperature, self.entropy, self.chunk_tokens = temperature, entropy, chunk_tokens
        self.result: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        hidden_NH = hidden_BTH.flatten(0, 1).index_select(0, self.index_N)
        self.result = chunked_logprobs(hidden_NH, self.output, self.targets_N,
                                       temperature=self.temperature, entropy=self.entropy,
                                       chunk_tokens=self.chunk_tokens)  # fmt: skip
        return self.result[0]


def output_layer(model: Any) -> torch.nn.Linear | None:
    """The model's output layer when the head can stand in for it (a plain Linear), else None."""
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if get is not None else None
    return layer if type(layer) is torch.nn.Linear else None


@contextlib.contextmanager
def head_installed(model: Any, head: LogprobHead) -> Iterator[None]:
    """Inside: `model`'s output layer is `head` (the original is restored on exit)."""
    original = model.get_output_embeddings()
    model.set_output_embeddings(head)
    try:
        yield
    finally:
        model.set_output_embeddings(original)


def forward_scores(model: Any, batch: SFTBatch, *, temperature: float = 1.0,
                   entropy: bool = False, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                   ) -> TokenScores:  # fmt: skip
    """Run `model` on `batch` (as `forward_logits` does) with the fused head: the target
    logprobs, and the entropy when `entropy`, at the trained positions, in the per-sample view.

    A model whose output layer the head cannot stand in for (`output_layer` is None) gets the
    logits path instead, with the same result. `batch.n_trained_tokens` must be the number of
    targets ≠ -100, as `prepare_sft_batch` / `prepare_prefix_shared_batch` make it: the
    positions are selected with that count known on the host, so without a device sync.
    """
    output = output_layer(model)
    if output is None:
        return scores_of(forward_logits(model, batch), batch, temperature=temperature,
                         entropy=entropy)  # fmt: skip
    targets = batch.target_ids.flatten()
    # the trained positions, their count known on the host: no device-to-host sync
    trained_N = torch.nonzero_static(targets != IGNORE_INDEX, size=batch.n_trained_tokens)[:, 0]
    # prompt-shared rows: each per-sample position's slot in the rows the model runs on
    slots_N = trained_N if batch.source_index is None else batch.source_index.flatten()[trained_N]
    head = LogprobHead(output, slots_N, targets[trained_N], temperature, entropy, chunk_tokens)
    with head_installed(model, head):
        run_model(model, batch)
    assert head.result is not None, "the model did not call its output layer"

    def per_sample(values_N: torch.Tensor) -> torch.Tensor:
        zeros = values_N.new_zeros(targets.shape)
        return zeros.index_copy(0, trained_N, values_N).view(batch.target_ids.shape)

    logprobs_N, entropy_N = head.result
    return TokenScores(per_sample(logprobs_N), None if entropy_N is None else per_sample(entropy_N))


def scores_of(inputs: torch.Tensor | TokenScores, batch: SFTBatch, *, temperature: float = 1.0,
              entropy: bool = False) -> TokenScores:  # fmt: skip
    """`inputs` as `TokenScores`: as given when they are, else computed from [B, T, V] logits
    the way the logits path always has (per-row fp32 logprobs; a full fp32 log-softmax for the
    entropy)."""
    if isinstance(inputs, TokenScores):
        if entropy and inputs.entropy_BT is None:
            raise ValueError("this loss needs the entropy; run forward_scores(entropy=True)")
        return inputs
    logits = temper_logits(inputs, temperature)
    entropy_BT = None
    if entropy:
        logp_BTV = torch.log_softmax(logits.float(), dim=-1)
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(dim=-1)
    return TokenScores(token_logprobs(logits, batch.target_ids), entropy_BT)


@dataclass(frozen=True)
class TemperedLogprobs(ReadsScores):
    """The per-token reader of `compute_logprobs`: [B, T] target logprobs under logits / T."""

    temperature: float = 1.0

    def __call__(self, inputs: torch.Tensor | TokenScores, batch: SFTBatch) -> torch.Tensor:
        return scores_of(inputs, batch, temperature=self.temperature).logprobs_BT
