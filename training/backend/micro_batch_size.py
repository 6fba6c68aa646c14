"""`backend.micro_batch_tokens: auto`: the largest micro-batch the device's free memory holds.

What it guarantees: an *estimate*, from the model's shape alone, of the bytes a forward +
backward keeps per slot of a micro-batch (a token or padding: what the budget counts) and of
the bytes that do not grow with the micro-batch, and from the device's free memory the largest
micro-batch (a multiple of `pack_length` when packing, at most `CAP_TOKENS`) whose estimate leaves
`MARGIN` of the free memory unused. The choice is monotone in the free memory. The estimate is
an upper bound of the tensors autograd saves, within 2x (tests/test_micro_batch_size.py
measures them with `saved_tensors_hooks` on two model shapes, with and without activation
checkpointing: 1.04-1.2x without, 1.4-1.8x with); the margin is for what it does not model.

Per decoder layer and slot, in bytes, c the compute dtype's size (2 for bf16), for an HF Llama/
Qwen2-style layer (RMSNorm, RoPE, GQA attention, SwiGLU MLP), as autograd saves them:
- each of the 2 RMSNorms: its fp32 input (4·d) and the normalised value cast back (c·d), and its
  output (c·d), which the next linears save;
- attention: the rotated query and the attention output (c·q each, q = heads x head_dim), the
  keys and values (c·kv each; with `sdpa` transformers repeats the K/V heads to q first, so c·q),
  and the kernel's fp32 logsumexp (4·heads); with `sdpa`'s 4D mask ([rows, 1, row, row]),
  SDPA's own additive copy of it (c x the row's length; none with the varlen/segments
  attention). RoPE saves only cos/sin (shared by all layers). `eager` attention also keeps
  the [heads, row] softmax weights (2·c + 4 bytes per pair);
- the MLP: gate and up projections, SiLU(gate) and their product (4·c·i).
Once per model and slot: cos and sin (2·c·head_dim), the final norm (4·d + c·d), the head's
input (c·d) and ~32 bytes of token ids and positions.
With activation checkpointing (HF's, non-reentrant) a layer keeps only its input (c·d) and
backward recomputes one layer at a time (one layer's bytes). Backward also holds the gradients
of the layer it is in: one more layer's bytes, in both cases.

Fixed bytes: the fused logprob head's one chunk of logits (training/data/logprob_head.py:
chunk x V x (2·c + 12), its fp32 temporaries and the backward's compute-dtype copy), or
nothing per chunk when the model has no plain output layer (then [slots x V] logits, V x (c + 8)
per slot). The training state allocated after the model is built: gradients and the optimizer's
moments (AdamW: 2, in the parameters' dtype, allocated at the first step), and under FSDP2 with
`accumulate_unsharded` the gathered parameters (c per parameter) and unsharded fp32 gradients
kept through an op (else the gathered root and two layers at a time). Gradients and moments are
this rank's shards (1/world of the model); the gathered ones are whole. The model's own
parameters are already in use when the free memory is read, so they are not subtracted again.
Against a GPU: for the first H100 check's configuration (the logits path, 8,192-token
micro-batches) these terms give 32.3 GiB; it peaked at 29.7 GiB (docs/gpus.md).

Not modelled (the margin's job): the CUDA context and cuBLAS/NCCL workspaces, the caching
allocator's fragmentation, LoRA adapters' own activations (small at rank ≪ hidden, except a
lora dropout > 0, which copies each adapted input), a loss function that asks for [B, T, V]
logits although the model has a plain head, and memory others take after the choice (an
engine started later on the same GPU). Models the run itself builds later (an RL run's
reference and critic) are left room for by the caller (`auto_reserve_params`,
training/recipes/rl_models.py).

Pure: no torch; training/backend/micro_batch_auto.py reads the model and the device and calls
these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

MARGIN = 0.25  # of the free memory, left unused
CAP_TOKENS = 65_536  # beyond this, launches are amortised already (docs/gpus.md)
CPU_TOKENS = 8192  # `auto` on CPU: the fixed budget every CPU test and figure was made with
UNPACKED_GRANULE = 256  # unpacked micro-batches are chosen in steps of this many tokens
Attention = Literal["masked", "varlen", "eager"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of an HF decoder that set its activation memory."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of_config(cls, config: Any, *, vocab: int | None = None) -> ModelShape:
        """From an HF config (`hidden_size`, `intermediate_size`, ...); `vocab`: the output
        layer's width when it is not the config's vocabulary (a value head)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(hidden=config.hidden_size, intermediate=config.intermediate_size,
                   layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, vocab=vocab or config.vocab_size)  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """How the model runs: compute dtype size, attention kind, checkpointing, the head."""

    compute_bytes: int = 2
    attention: Attention = "masked"  # sdpa with a 4D mask; varlen: segments / flash
    row_tokens: int = 2048  # the longest row (pack_length when packing): the mask's width
    checkpointing: bool = False
    fused_head: bool = True
    chunk_tokens: int = 2048
    trains: bool = True  # False: no-grad passes only (a frozen reference)


def layer_bytes_per_token(m: ModelShape, s: Setup) -> float:
    """What one decoder layer saves for backward, per slot (see the module docstring)."""
    c, d, q = s.compute_bytes, m.hidden, m.heads * m.head_dim
    kv = q if s.attention == "masked" else m.kv_heads * m.head_dim  # sdpa repeats K/V heads
    norms = 2 * (4 * d + c * d + c * d)
    attention = c * (2 * q + 2 * kv) + 4 * m.heads
    if s.attention == "masked":
        attention += c * s.row_tokens  # SDPA's own additive copy of the mask, in every layer
    if s.attention == "eager":
        attention += m.heads * s.row_tokens * (2 * c + 4)  # scores, softmax, its fp32 upcast
    return norms + attention + 4 * c * m.intermediate


def activation_bytes_per_token(m: ModelShape, s: Setup) -> float:
    """Peak bytes per slot of a forward + backward (or of a no-grad forward when not
    `s.trains`): the saved layers, one more layer for backward, and the per-model terms."""
    c, d = s.compute_bytes, m.hidden
    layer = layer_bytes_per_token(m, s)
    shared = 2 * c * m.head_dim + (4 * d + c * d) + c * d + 32
    if not s.fused_head:
        shared += m.vocab * (c + 8)  # [slots, V] logits and their fp32 log-softmax
    if not s.trains:
        return layer + shared  # nothing is kept between layers; one layer's transients
    kept = m.layers * c * d + layer if s.checkpointing else m.layers * layer
    return kept + layer + shared


def head_chunk_bytes(m: ModelShape, s: Setup) -> int:
    """The fused head's one chunk of logits and its fp32 temporaries (none without it)."""
    return s.chunk_tokens * m.vocab * (2 * s.compute_bytes + 12) if s.fused_head else 0


@dataclass(frozen=True)
class TrainingState:
    """Parameter counts on this rank, in elements, and the sizes that turn them into bytes."""

    params: int  # every parameter held by this rank (its shards under FSDP)
    trainable: int  # the trainable ones among them
    param_bytes: int = 4  # the stored dtype's size (fp32 masters under FSDP mixed precision)
    optimizer_states: int = 2  # moments per trainable parameter (AdamW: 2)
    gathered_params: int = 0  # parameters FSDP holds unsharded at once (0: not sharded)
    gathered_grads: int = 0  # trainable ones among them, unsharded fp32 gradients
    compute_bytes: int = 2


def state_bytes(t: TrainingState) -> dict[str, int]:
    """The training state's bytes on this rank, by part: `params` (already allocated when the
    model is built), and `grads`, `optimizer`, `gathered`, allocated later."""
    return {"params": t.params * t.param_bytes, "grads": t.trainable * t.param_bytes,
            "optimizer": t.optimizer_states * t.trainable * t.param_bytes,
            "gathered": t.gathered_params * t.compute_bytes + t.gathered_grads * 4}  # fmt: skip


def pending_bytes(t: TrainingState) -> int:
    """What the training state will still allocate after the model is built."""
    parts = state_bytes(t)
    return parts["grads"] + parts["optimizer"] + parts["gathered"]


def choose_micro_batch_tokens(free_bytes: float, *, per_token: float, fixed_bytes: float,
                              multiple_of: int = UNPACKED_GRANULE, margin: float = MARGIN,
                              cap: int = CAP_TOKENS) -> int:  # fmt: skip
    """The largest multiple of `multiple_of`, at most `cap` (rounded down to a multiple), with
    `fixed_bytes + tokens x per_token <= (1 - margin) x free_bytes`; `multiple_of` itself
    (one packed row) when not even that fits, the least micro-batch that can run.

    Monotone: more free memory never gives a smaller micro-batch.
    """
    if per_token <= 0 or multiple_of < 1:
        raise ValueError(f"per_token={per_token}, multiple_of={multiple_of}: both must be > 0")
    budget = (1.0 - margin) * free_bytes - fixed_bytes
    fits = int(max(budget, 0.0) // per_token) // multiple_of * multiple_of
    top = max(multiple_of, cap // multiple_of * multiple_of)
    return max(multiple_of, min(fits, top))
