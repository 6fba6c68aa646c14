"""Padding-free attention for packed and prompt-shared rows: no 4D mask built by transformers, no
K/V expansion (`repeat_kv`), and on CUDA no work on the masked-out pairs.

`use_segment_attention(model)` registers the attention function `"rollouts_segments"` with
transformers and selects it for `model` (`model.attention: segments` in a config). Then
`forward_logits` (training/data/packing.py) hands each forward the batch's layout through
`segment_kwargs`:

- packed (and one-sample) rows: the lengths of the samples along the flattened [B*T] rows,
  from the host (`SFTBatch.segment_lengths`, pads folded into their row's last sample, which
  they follow and which never attends to them). On CUDA in bf16/fp16 each layer runs
  `torch.nn.attention.varlen.varlen_attn` (FlashAttention varlen, causal, GQA) on them.
- prompt-shared rows (training/data/prefix_sharing.py): the tree mask [R, 1, W, W]. On CUDA
  each layer runs FlexAttention (compiled once per process: the first step pays the compile)
  with a block mask made once per forward from it, so the blocks no branch needs are skipped.

Elsewhere (CPU, the exact twin that the tests compare with today's path) each layer runs one
SDPA call with a boolean mask built once per forward and GQA inside the kernel: the same math
as the dense path, minus `repeat_kv`. Without segment kwargs (the idle passes: one row, one
sample) it is causal SDPA; generation, which brings a left-padding mask, runs under
`dense_attention` (sdpa).

Not covered: sliding-window layers (refused), dropout inside attention (the trainer uses none),
attention weights as outputs.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from plumbing.errors import ConfigError

SEGMENT_ATTENTION = "rollouts_segments"


def register() -> None:
    """Make `"rollouts_segments"` a transformers attention implementation (idempotent). It has
    no mask builder on purpose: transformers then builds no mask at all (nor looks for packed
    rows in `position_ids`, a host sync on CUDA)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)


@contextlib.contextmanager
def dense_attention(model: Any) -> Iterator[None]:
    """Inside: `model` runs sdpa (generation, whose left-padding mask this function does not
    take); the segment attention again on exit. A no-op for any other implementation."""
    if getattr(model.config, "_attn_implementation", None) != SEGMENT_ATTENTION:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(SEGMENT_ATTENTION)


def use_segment_attention(model: Any) -> Any:
    """Select the segment attention for `model` (an HF causal LM, LoRA-wrapped or not); returns it.

    Raises:
        ConfigError: the model has sliding-window layers (their window is not applied here).
    """
    config = model.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ConfigError(
            f"{type(model).__name__} has sliding-window attention layers, which "
            f"attention={SEGMENT_ATTENTION!r} does not apply; use model.attention: sdpa"
        )
    register()
    model.set_attn_implementation(SEGMENT_ATTENTION)
    return model


@dataclass(eq=False)
class Segments:
    """One forward's layout, shared by its layers: sample lengths along the flattened rows (a
    packed batch), or the tree mask (a prompt-shared batch)."""

    shape: tuple[int, int]  # [B, T] of the model's rows
    lengths: tuple[int, ...] = ()
    tree_mask: torch.Tensor | None = None
    _cache: dict[str, Any] = field(default_factory=dict)

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        if "cu" not in self._cache:
            cu = [0, *itertools.accumulate(self.lengths)]
            # made on the host, then one copy that does not wait for the queued GPU work
            # (`torch.tensor(..., device=cuda)` would: a pageable copy synchronises the stream)
            host = torch.tensor(cu, dtype=torch.int32, device="cpu")
            self._cache["cu"] = host.to(device, non_blocking=True)
        return self._cache["cu"]

    def dense_mask(self, device: torch.device) -> torch.Tensor:
        """[B, 1, T, T] bool, True = may attend: causal within each segment (the CPU twin)."""
        if self.tree_mask is not None:
            return self.tree_mask
        if "dense" not in self._cache:
            b, t = self.shape
            # made on `device` from the lengths alone (no [B, T, T] host mask copied over, no
            # stream sync: a non-blocking copy of the lengths, repeat_interleave's output_size)
            lengths = torch.tensor(self.lengths, device="cpu").to(device, non_blocking=True)
            seg = torch.repeat_interleave(torch.arange(len(self.lengths), device=device), lengths,
                                          output_size=b * t).view(b, t)  # fmt: skip
            causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
            mask = (seg[:, :, None] == seg[:, None, :]) & causal
            self._cache["dense"] = mask[:, None]
        return self._cache["dense"]

    def block_mask(self, n_heads: int) -> Any:
        """FlexAttention's block mask of the tree mask (built once per forward)."""
        if "block" not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            tree = self.tree_mask
            assert tree is not None
            b, t = self.shape

            def allowed(b_, h_, q, k):
                return tree[b_, 0, q, k]

            self._cache["block"] = create_block_mask(allowed, b, None, t, t, device=tree.device)
        return self._cache["block"]


def segment_kwargs(model: Any, batch: Any) -> dict[str, Any]:
    """The model kwargs that carry a batch's layout (an `SFTBatch` or `RLBatch`) to
    `segment_attention`; {} for any other attention implementation."""
    if getattr(model.config, "_attn_implementation", None) != SEGMENT_ATTENTION:
        return {}
    b, t = batch.input_ids.shape
    tree_mask = batch.attention_mask
    lengths = tuple(getattr(batch, "segment_lengths", ()))
    if not lengths and not batch.is_packed:  # a batch built elsewhere: one sample per row
        lengths = (t,) * b
    if tree_mask is None and sum(lengths) != b * t:
        raise ValueError(
            f"the batch's segment_lengths sum to {sum(lengths)} but its rows hold {b * t} "
            "slots: build packed batches with training/data/packing.py prepare_sft_batch"
        )
    return {"segments": Segments((b, t), lengths, tree_mask)}


# Opaque to torch.compile (`backend.fsdp.compile_layers`): traced, the layout's Python values
# (the number of samples, their lengths, the cache of masks) became guards and every micro-batch
# with another sample count recompiled the layers; disabled, each layer breaks its graph once
# here, the same way for every batch. FlexAttention stays compiled (`_compiled_flex` compiles
# itself wherever it is called), and the kernel calls are single ops, so nothing is lost.
@torch.compiler.disable
def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      segments: Segments | None = None, **kwargs: Any
                      ) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention-function signature: q [B, Hq, T, D], k/v [B, Hkv, S, D] →
    ([B, T, Hq, D], None)."""
    if dropout:
        raise ConfigError(f"attention={SEGMENT_ATTENTION!r} has no attention dropout")
    if segments is None:  # one sample per row (the idle passes): causal, GQA in the kernel
        causal = attention_mask is None and query.shape[2] > 1 and query.shape[2] == key.shape[2]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             is_causal=causal, scale=scaling, enable_gqa=True)  # fmt: skip
    elif query.is_cuda and segments.tree_mask is None and query.dtype in _FLASH_DTYPES:
        out = _varlen(query, key, value, segments, scaling)
    elif query.is_cuda and segments.tree_mask is not None:
        out = _compiled_flex()(query, key, value, block_mask=segments.block_mask(query.shape[1]),
                               scale=scaling, enable_gqa=True)  # fmt: skip
    else:  # CPU, or fp32 on CUDA (FlashAttention takes bf16/fp16 only)
        mask = segments.dense_mask(query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=True)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_FLEX: list[Any] = []


def _compiled_flex() -> Any:
    """FlexAttention compiled once per process: uncompiled, it materialises every score."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=True))
    return _FLEX[0]


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments,
            scaling: float | None) -> torch.Tensor:  # fmt: skip
    """FlashAttention varlen over the flattened rows; [B, Hq, T, D] like SDPA's output. Without
    `torch.nn.attention.varlen` (torch < 2.9) the dense-mask SDPA path, once warned."""
    kernel = varlen_kernel()
    if kernel is None:
        mask = segments.dense_mask(query.device)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                              enable_gqa=True)  # fmt: skip
    b, hq, t, d = query.shape
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    cu = segments.cu_seqlens(query.device)
    longest = max(segments.lengths)
    return kernel(q, k, v, cu, longest, scaling).view(b, t, hq, d).transpose(1, 2)


@dataclass(frozen=True)
class VarlenKernel:
    """`varlen_attn` called causally with GQA and a scale, whichever of its signatures this
    torch has: torch 2.9-2.11 and some later builds take `is_causal` or `window_size=(-1, 0)`
    for causal, and not every build takes `enable_gqa` (then K/V are expanded here, as
    `repeat_kv` would: query head h reads KV head h // (Hq / Hkv)) or `scale` (then q is
    rescaled: softmax(s·qk) = softmax(d^-1/2·(s·d^1/2·q)k))."""

    fn: Any
    window: bool
    gqa: bool
    scale: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                 longest: int, scaling: float | None) -> torch.Tensor:  # fmt: skip
        kwargs: dict[str, Any] = {"window_size": (-1, 0)} if self.window else {"is_causal": True}
        if self.gqa:
            kwargs["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        if self.scale:
            kwargs["scale"] = scaling
        elif scaling is not None:
            q = q * (scaling * q.shape[-1] ** 0.5)
        return self.fn(q, k, v, cu, cu, longest, longest, **kwargs)

    @classmethod
    def of(cls, fn: Any) -> VarlenKernel:
        params = inspect.signature(fn).parameters
        return cls(fn, "window_size" in params, "enable_gqa" in params, "scale" in params)


_VARLEN: list[VarlenKernel | None] = []


def varlen_kernel() -> VarlenKernel | None:
    """This torch's FlashAttention varlen, adapted (None, with one warning, when it has none)."""
    if not _VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            warnings.warn(f"torch {torch.__version__} has no torch.nn.attention.varlen: packed "
                          f"rows run SDPA on a dense mask (torch >= 2.9 for FlashAttention "
                          f"varlen)", stacklevel=3)  # fmt: skip
            _VARLEN.append(None)
        else:
            _VARLEN.append(VarlenKernel.of(varlen_attn))
    return _VARLEN[0]
