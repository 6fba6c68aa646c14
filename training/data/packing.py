"""Turn tokenized SFT samples into padded or packed tensor batches, and score them.

Packing puts several samples in one row. Attention isolation comes from `position_ids`: they
restart at 0 for every sample, and `forward_logits` calls the model with `attention_mask=None`
and no cache, so transformers' masking utilities (≥4.53; `find_packed_sequence_indices`) split
each row into its samples and build a block-diagonal causal mask (sdpa/eager/flex); flash
attention is refused for packed rows (`PACKING_AWARE_ATTENTION`). RoPE positions restart too, so a packed
sample sees exactly what it would see alone. Padding continues the positions of the row's last
sample, so a row holding one sample plus padding still counts as a single sequence: a batch
without packing keeps SDPA's fast `is_causal` path, and real tokens never attend to the pads
that follow them. The one batch that does carry a (4D) mask is the prompt-shared RL batch of
training/data/prefix_sharing.py; `forward_logits` maps its logits back to one sample per row.

Targets are pre-shifted: `target_ids[b, t]` is the token at `t+1` of the same sample when that
token is trained, else -100. The last token of a sample therefore never predicts the first
token of the next one, and pads never carry a loss.

Pure: imports torch only (no engines, no HTTP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from plumbing.errors import ConfigError
from training.data.row_packing import pack_balanced as pack_balanced
from training.data.row_packing import pack_sequences as pack_sequences
from training.data.scores import ReadsScores, TokenScores
from training.data.segment_attention import segment_kwargs
from training.data.tokenize import TokenizedSample

IGNORE_INDEX = -100

# Attention implementations whose transformers mask/kernel path detects packed rows from
# position_ids when attention_mask is None. sdpa and eager are tested here (CPU). Not flash
# attention: transformers finds packed samples from position_ids only in a batch of ONE row
# (modeling_flash_attention_utils.py, `batch_size != 1`), and packed micro-batches have
# several, whose samples would attend across their boundaries; "rollouts_segments" is the
# varlen path (training/data/segment_attention.py).
PACKING_AWARE_ATTENTION = frozenset({"sdpa", "eager", "flex_attention"})
# Attention implementations that apply a custom 4D mask as given (transformers ≥4.53 returns a
# 4D mask unchanged): sdpa takes it boolean, eager adds it, so it gets an additive float copy.
CUSTOM_MASK_ATTENTION = frozenset({"sdpa", "eager"})


@dataclass(frozen=True, eq=False)
class SFTBatch:
    """Tensors for one SFT forward pass, all [B, T], plus token counts.

    `segment_ids[b, t]` is the index (in the list given to `prepare_sft_batch`) of the sample
    the token belongs to, -1 for padding. `is_packed` is True when some row holds more than
    one sample.

    Prompt-shared batches (training/data/prefix_sharing.py) feed the model other rows than the
    per-sample view: `input_ids` / `position_ids` are then the model's rows [R, W], with
    `attention_mask` [R, 1, W, W] (bool, True = may attend) and `source_index` [B, T], the flat
    index into [R * W] of each per-sample position; `target_ids` / `segment_ids` stay [B, T].
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    segment_ids: torch.Tensor
    n_samples: int
    n_trained_tokens: int
    n_tokens: int
    n_slots: int
    is_packed: bool
    attention_mask: torch.Tensor | None = None
    source_index: torch.Tensor | None = None
    # the samples' lengths along the flattened [B*T] rows (a row's pads count with its last
    # sample), from the host: the segment attention's layout (training/data/segment_attention.py)
    segment_lengths: tuple[int, ...] = ()

    @property
    def padding_efficiency(self) -> float:
        """Fraction of the [B, T] slots holding real tokens."""
        return self.n_tokens / self.n_slots

    def to(self, device: torch.device | str) -> SFTBatch:
        """The same batch with its tensors on `device`."""
        return replace(
            self,
            input_ids=move_to(self.input_ids, device),
            position_ids=move_to(self.position_ids, device),
            target_ids=move_to(self.target_ids, device),
            segment_ids=move_to(self.segment_ids, device),
            attention_mask=move_to(self.attention_mask, device),
            source_index=move_to(self.source_index, device),
        )


def move_to(t: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """`t` on `device`; from host memory to a GPU through pinned memory, without blocking the
    host (a copy from pageable memory waits for all queued GPU work)."""
    if t is None:
        return None
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def prepare_sft_batch(
    samples: Sequence[TokenizedSample],
    *,
    pad_id: int,
    packing: bool = True,
    max_tokens_per_row: int | None = None,
) -> SFTBatch:
    """Build the [B, T] tensors for a list of samples, packed or one sample per row.

    Args:
        samples: tokenized samples (any sub-list of a dataset; the cost is linear in tokens).
        pad_id: token id written in padding slots (never attended to by real tokens, never a
            target).
        packing: pack several samples per row (default); else one per row, right-padded.
        max_tokens_per_row: row capacity when packing; defaults to the longest sample, so a
            packed batch is never wider than the unpacked one.

    Returns:
        The batch; rows are padded to the longest row.

    Raises:
        ValueError: if `samples` is empty.
        ConfigError: if a sample is longer than `max_tokens_per_row`.
    """
    if not samples:
        raise ValueError("prepare_sft_batch needs at least one sample")
    lengths = [len(s) for s in samples]
    if packing:
        rows = pack_balanced(samples, max_tokens_per_row or max(lengths))
    else:
        rows = [[i] for i in range(len(samples))]
    width = max(sum(lengths[i] for i in row) for row in rows)
    shape = (len(rows), width)
    # Built as flat Python lists and converted once: a few tensor ops per sample cost more
    # than the lists for the short samples of RL batches (hundreds of samples per step).
    ids_: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    segments: list[int] = []
    segment_lengths: list[int] = []
    for row in rows:
        used = 0
        segment_lengths.extend(lengths[i] for i in row)
        for i in row:
            ids, mask, n = samples[i].input_ids, samples[i].loss_mask, lengths[i]
            ids_.extend(ids)
            positions.extend(range(n))
            targets.extend(t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:], strict=True))
            targets.append(IGNORE_INDEX)  # the last token has no next token
            segments.extend([i] * n)
            used += n
        # Pads continue the last sample's positions: see the module docstring.
        pads, last = width - used, lengths[row[-1]]
        segment_lengths[-1] += pads
        ids_.extend([pad_id] * pads)
        positions.extend(range(last, last + pads))
        targets.extend([IGNORE_INDEX] * pads)
        segments.extend([-1] * pads)
    input_ids = torch.tensor(ids_, dtype=torch.long).view(shape)
    position_ids = torch.tensor(positions, dtype=torch.long).view(shape)
    target_ids = torch.tensor(targets, dtype=torch.long).view(shape)
    segment_ids = torch.tensor(segments, dtype=torch.long).view(shape)
    return SFTBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        target_ids=target_ids,
        segment_ids=segment_ids,
        n_samples=len(samples),
        n_trained_tokens=int((target_ids != IGNORE_INDEX).sum()),
        n_tokens=sum(lengths),
        n_slots=shape[0] * shape[1],
        is_packed=any(len(row) > 1 for row in rows),
        segment_lengths=tuple(segment_lengths),
    )


def forward_logits(model: Any, batch: SFTBatch) -> torch.Tensor:
    """Logits [B, T, V] of a causal LM on a batch, in the per-sample view (see `run_model`)."""
    out = run_model(model, batch)
    if batch.source_index is None:
        return out.logits
    return out.logits.flatten(0, 1)[batch.source_index]


def run_model(model: Any, batch: SFTBatch) -> Any:
    """Run a causal LM on a batch so that no token attends across samples or to padding.

    Args:
        model: an HF causal LM (transformers ≥4.53) on the batch's device.
        batch: from `prepare_sft_batch` or `prepare_prefix_shared_batch` (moved with
            `batch.to(device)` if needed).

    Returns:
        The model's output on the rows it ran on ([R, W], `batch.input_ids`'s shape): its
        `logits` map to the per-sample view through `batch.source_index` when it is set.

    Raises:
        ConfigError: if the model's attention implementation cannot run the batch: packed rows
            need one that isolates samples via `position_ids`, prompt-shared rows one that
            takes a custom 4D mask.
    """
    impl = getattr(model.config, "_attn_implementation", None)
    mask = batch.attention_mask
    layout = segment_kwargs(model, batch)
    if layout:  # its own kernels isolate samples and apply the tree mask (no 4D mask built)
        mask = None
    elif mask is not None:
        if impl not in CUSTOM_MASK_ATTENTION:
            raise ConfigError(
                f"attn_implementation {impl!r} cannot run prompt-shared rows (a 4D attention "
                f"mask); load the model with one of {sorted(CUSTOM_MASK_ATTENTION)} or turn "
                "prompt sharing off (share_prompts=False)"
            )
        if impl == "eager":  # eager adds the mask to the scores
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
    elif batch.is_packed and impl not in PACKING_AWARE_ATTENTION:
        raise ConfigError(
            f"attn_implementation {impl!r} does not isolate packed samples; load the model "
            f"with one of {sorted(PACKING_AWARE_ATTENTION)} or turn packing off"
        )
    # Without a 4D mask, attention_mask must stay None: a 2D mask would switch off packed-row
    # detection.
    return model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=mask,
        use_cache=False,
        **layout,
    )


def temper_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of the distribution an engine samples from at `temperature` (logits / T).

    Engine logprobs are those of the tempered distribution, so every trainer-side logprob that
    is compared with them or with each other (policy, old, reference) is tempered the same
    way. T = 0 (greedy) and T = 1 leave the logits as they are.
    """
    return logits if temperature in (0.0, 1.0) else logits / temperature


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each target token, 0 where the target is -100.

    Computed as gathered logit minus logsumexp, so no [B, T, V] log-softmax is kept for
    backward; half-precision logits are upcast one row at a time to bound the extra memory.

    Args:
        logits: [B, T, V].
        target_ids: [B, T], -100 where there is no target.

    Returns:
        [B, T] float log-probabilities (float32 for half-precision logits).
    """
    valid = target_ids != IGNORE_INDEX
    safe = target_ids.masked_fill(~valid, 0).unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        logprobs = logits.gather(-1, safe).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    else:
        rows = []
        for row_logits, row_targets in zip(logits, safe, strict=True):
            row_logits = row_logits.float()
            picked = row_logits.gather(-1, row_targets).squeeze(-1)
            rows.append(picked - torch.logsumexp(row_logits, dim=-1))
        logprobs = torch.stack(rows)
    return logprobs.masked_fill(~valid, 0.0)


@dataclass(frozen=True)
class SFTLoss(ReadsScores):
    """Token-mean cross-entropy over the batch's trained tokens (`sft_loss`).

    Called with the fused head's `TokenScores` (the backend) or with [B, T, V] logits from
    `forward_logits`, and the batch they came from. `normalizer`: divide the summed loss by
    this instead of the batch's own `n_trained_tokens`; for gradient accumulation pass the
    whole step's trained-token count to every micro-batch, so the step's gradient is the
    token-mean over the step.

    Returns the loss tensor, and metrics: `loss` (this batch's token-mean), `loss_sum` (summed
    cross-entropy; add these up across micro-batches) and `n_trained_tokens`. `loss` and
    `loss_sum` are 0-dim tensors (read on the host once per operation, not per micro-batch).
    """

    def __call__(self, inputs: torch.Tensor | TokenScores, batch: SFTBatch, *,
                 normalizer: int | None = None) -> tuple[torch.Tensor, dict]:  # fmt: skip
        if isinstance(inputs, TokenScores):
            logprobs_BT = inputs.logprobs_BT
        else:
            logprobs_BT = token_logprobs(inputs, batch.target_ids)
        loss_sum = -logprobs_BT.sum()
        n = batch.n_trained_tokens
        loss = loss_sum / (normalizer if normalizer is not None else max(n, 1))
        total = loss_sum.detach()
        return loss, {"loss": total / max(n, 1), "loss_sum": total, "n_trained_tokens": n}


sft_loss = SFTLoss()


def per_sample_loss(logits: torch.Tensor, batch: SFTBatch) -> torch.Tensor:
    """Mean cross-entropy over each sample's trained tokens.

    Args:
        logits: [B, T, V] from `forward_logits`.
        batch: the batch the logits came from.

    Returns:
        [n_samples], in the order of the samples given to `prepare_sft_batch` (0 for a sample
        without trained tokens).
    """
    logprobs = token_logprobs(logits, batch.target_ids)
    valid = batch.target_ids != IGNORE_INDEX
    segments = batch.segment_ids[valid]
    sums = torch.zeros(batch.n_samples, dtype=logprobs.dtype, device=logprobs.device)
    sums = sums.index_add(0, segments, -logprobs[valid])
    counts = torch.zeros_like(sums).index_add(0, segments, torch.ones_like(logprobs[valid]))
    return sums / counts.clamp(min=1)
