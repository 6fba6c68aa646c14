"""The model side of the local engine: an HF causal LM, a batched KV cache, one step at a time.

Contract:
- Every method runs on the scheduler's single worker thread, never concurrently; it reads the
  `Sequence` objects it is given and writes only their `runner_state` slot (results are
  returned, the scheduler applies them).
- The batch is a left-padded `DynamicCache` plus a 0/1 attention mask. A step (1) drops rows the
  scheduler no longer wants, (2) decodes one token for every remaining row, (3) prefills newly
  admitted sequences (identical prompts once, then shared) and merges them into the batch. So
  new requests join at the next step and never wait for the running ones to finish.
- Padding is masked and positions are counted per row, so a row's logits equal those of the
  same tokens run alone (up to float rounding, ~1e-6 in float32).
- `load_weights` validates every tensor (names, shapes) before copying any, so a failed update
  leaves the old weights in place.
- With LoRA (`enable_lora`, lora_runner.py) every forward passes each row's adapter through
  peft's `adapter_names`, so base and adapter rows share the batch and its KV cache; identical
  prompts share a prefill only when they also share the adapter. A base weight update
  replaces the base tensors and keeps the adapters.

Not covered: a prefix cache across requests (only identical prompts admitted in the same step
share their prefill), paged memory, chunked prefill of one long prompt.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

from .sampling import Sampled, sample, scaled_logprobs, top_logprobs
from .sequence import Sequence, TopLogprobs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightLoadError(Exception):
    """A weight update was refused; `message` is SGLang's wording for the failure."""


@dataclass
class Prefilled:
    seq: Sequence
    input_logprobs: list[float | None] | None
    input_top: list[TopLogprobs | None] | None
    cached_tokens: int


@dataclass
class StepOutput:
    tokens: list[tuple[Sequence, int, float, TopLogprobs | None]] = field(default_factory=list)
    prefilled: list[Prefilled] = field(default_factory=list)
    errors: list[tuple[Sequence, str]] = field(default_factory=list)


def _as_int_set(value) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


class ModelRunner:
    def __init__(
        self, model_path: str, *, dtype: str = "float32", device: str = "cpu", seed: int = 0
    ):
        self.lora: Any = None  # LoraAdapters once `enable_lora` was called
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.context_len = int(getattr(config, "max_position_embeddings", 2048))
        eos = _as_int_set(config.eos_token_id)
        with contextlib.suppress(OSError):
            eos |= _as_int_set(GenerationConfig.from_pretrained(model_path).eos_token_id)
        self.eos_ids = frozenset(eos)
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self._rows: list[Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None

    # ----- LoRA (lora_runner.py) ------------------------------------------------------------

    def enable_lora(self, max_lora_rank: int, target_modules: Seq[str]) -> None:
        from .lora_runner import LoraAdapters

        self.lora = LoraAdapters(
            self.model, max_lora_rank=max_lora_rank, target_modules=target_modules
        )

    def load_lora(self, name: str, path: str) -> None:
        self.lora.load(name, path)

    def delete_lora(self, name: str) -> None:
        self.lora.delete(name)

    def _forward(self, seqs: Seq[Sequence], **kwargs: Any) -> Any:
        """The model on a batch whose row i belongs to seqs[i] (its LoRA adapter, if any)."""
        if self.lora is None:
            return self.model(**kwargs)
        return self.lora.forward([s.item.lora_name for s in seqs], **kwargs)

    # ----- batch layout ---------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def _kv(self, cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _new_cache(self, kvs) -> DynamicCache:
        """A cache holding `kvs` (one (keys, values) per layer), without copying them.

        `DynamicCache(ddp_cache_data=...)` copies every tensor (an update of an empty layer is a
        `torch.cat`): on a 128-row batch that was ~12% of the engine's step time. Plain
        `DynamicLayer`s take the tensors as they are; other layer kinds (sliding window) go
        through their own `update`.
        """
        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in zip(cache.layers, kvs, strict=True):
            if type(layer) is DynamicLayer:
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            else:
                layer.update(k, v)
        return cache

    def reset(self) -> None:
        self._rows, self._cache, self._mask = [], None, None

    def _retain(self, keep: Seq[Sequence]) -> None:
        """Drop rows not in `keep`, then the left columns that became padding in every row."""
        wanted = set(keep)
        index = [i for i, s in enumerate(self._rows) if s in wanted]
        if len(index) == len(self._rows):
            return
        if not index:
            self.reset()
            return
        assert self._cache is not None and self._mask is not None
        rows = torch.tensor(index, device=self.device)
        mask = self._mask[rows]
        first = int(mask.any(0).nonzero()[0])
        self._mask = mask[:, first:]
        self._cache = self._new_cache(
            [(k[rows, :, first:], v[rows, :, first:]) for k, v in self._kv(self._cache)]
        )
        self._rows = [self._rows[i] for i in index]

    def _merge(self, seqs: list[Sequence], cache: DynamicCache, mask: torch.Tensor) -> None:
        if self._cache is None:
            self._rows, self._cache, self._mask = seqs, cache, mask
            return
        assert self._mask is not None
        width = max(mask.shape[1], self._mask.shape[1])

        def pad(t: torch.Tensor, cols: int) -> torch.Tensor:  # left-pad the sequence axis
            return F.pad(t, (0, 0, width - cols, 0)) if cols < width else t

        old_cols, new_cols = self._mask.shape[1], mask.shape[1]
        kvs = [
            (
                torch.cat([pad(k0, old_cols), pad(k1, new_cols)]),
                torch.cat([pad(v0, old_cols), pad(v1, new_cols)]),
            )
            for (k0, v0), (k1, v1) in zip(self._kv(self._cache), self._kv(cache), strict=True)
        ]
        self._mask = torch.cat(
            [F.pad(self._mask, (width - old_cols, 0)), F.pad(mask, (width - new_cols, 0))]
        )
        self._cache = self._new_cache(kvs)
        self._rows = self._rows + seqs

    # ----- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, keep: Seq[Sequence], admit: Seq[Sequence]) -> StepOutput:
        """Decode one token for the rows in `keep`, then prefill and merge `admit`."""
        out = StepOutput()
        self._retain(keep)
        if self._rows:
            try:
                self._decode(out)
            except Exception as exc:  # the batch state is unusable: fail its rows, keep serving
                logger.exception("decode step failed; failing %d running requests", len(self._rows))
                out.errors += [(s, f"Decode step failed: {exc!r}") for s in self._rows]
                self.reset()
        if admit:
            self._prefill_isolated(list(admit), out)
        return out

    def _prefill_isolated(self, admit: list[Sequence], out: StepOutput) -> None:
        """Prefill together; if that fails, each alone, so only the request at fault fails."""
        marks = (len(out.tokens), len(out.prefilled), len(out.errors))
        try:
            self._prefill(admit, out)
            return
        except Exception as exc:
            del out.tokens[marks[0] :], out.prefilled[marks[1] :], out.errors[marks[2] :]
            if len(admit) == 1:
                logger.exception("prefill failed for request %s", admit[0].rid)
                out.errors.append((admit[0], f"Prefill failed: {exc!r}"))
                return
        for seq in admit:
            self._prefill_isolated([seq], out)

    def _decode(self, out: StepOutput) -> None:
        assert self._mask is not None
        tokens = torch.tensor([[s.output_ids[-1]] for s in self._rows], device=self.device)
        ones = torch.ones(len(self._rows), 1, dtype=self._mask.dtype, device=self.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        positions = self._mask.sum(-1, keepdim=True) - 1
        result = self._forward(
            self._rows,
            input_ids=tokens,
            attention_mask=self._mask,
            position_ids=positions,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._collect(out, result.logits[:, -1, :], self._rows)

    def _collect(self, out: StepOutput, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        try:
            sampled: Sampled = sample(logits, seqs, self.eos_ids, self.generator)
        except Exception as exc:
            if len(seqs) == 1:
                logger.exception("sampling failed for request %s", seqs[0].rid)
                out.errors.append((seqs[0], f"Sampling failed: {exc!r}"))
                return
            # one row's parameters broke the batched sampler: sample row by row instead
            for row, seq in enumerate(seqs):
                self._collect(out, logits[row : row + 1], [seq])
            return
        for i, seq in enumerate(seqs):
            if sampled.errors[i] is not None:
                out.errors.append((seq, sampled.errors[i]))
            else:
                out.tokens.append((seq, sampled.tokens[i], sampled.logprobs[i], sampled.tops[i]))

    def _prefill(self, admit: list[Sequence], out: StepOutput) -> None:
        for seq in admit:
            seed = seq.item.params.sampling_seed
            if seed is not None and seq.runner_state is None:
                seq.runner_state = torch.Generator(self.device).manual_seed(seed)
        # identical prompts for the same adapter are prefilled once
        unique: dict[tuple[str | None, tuple[int, ...]], int] = {}
        row_of = [
            unique.setdefault((s.item.lora_name, tuple(s.prefill_ids)), len(unique)) for s in admit
        ]
        row_seqs = {r: s for s, r in zip(admit, row_of, strict=True)}  # a sequence per row
        prompts = [ids for _, ids in unique]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=self.device)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p, device=self.device)
            mask[r, width - len(p) :] = 1
        keep_last = 1
        for s in admit:
            if s.item.return_logprob and not s.prefilled:
                keep_last = max(keep_last, len(s.item.input_ids) - s.item.logprob_start_len)
        cache = DynamicCache(config=self.model.config)
        result = self._forward(
            [row_seqs[r] for r in range(len(prompts))],
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep_last,
        )
        logits = result.logits  # [unique, keep_last, V]
        first_use: set[int] = set()
        for s, r in zip(admit, row_of, strict=True):
            cached = len(s.prefill_ids) if r in first_use else 0
            first_use.add(r)
            lp, top = (None, None)
            if s.item.return_logprob and not s.prefilled:
                lp, top = self._input_logprobs(s, logits[r], keep_last)
            out.prefilled.append(Prefilled(s, lp, top, cached))

        decoding = [
            (s, r) for s, r in zip(admit, row_of, strict=True) if s.item.params.max_new_tokens > 0
        ]
        if not decoding:
            return
        rows = torch.tensor([r for _, r in decoding], device=self.device)
        seqs = [s for s, _ in decoding]
        self._collect(out, logits[rows, -1, :], seqs)
        pad = ~mask.bool()[:, None, :, None]
        kvs = [
            (k.masked_fill(pad, 0)[rows], v.masked_fill(pad, 0)[rows]) for k, v in self._kv(cache)
        ]
        first = int(mask[rows].any(0).nonzero()[0])
        self._merge(
            seqs,
            self._new_cache([(k[:, :, first:], v[:, :, first:]) for k, v in kvs]),
            mask[rows][:, first:],
        )

    def _input_logprobs(self, seq: Sequence, logits: torch.Tensor, kept: int):
        """Entries for prompt positions start..len-1; entry 0 is None (SGLang's alignment)."""
        prompt, start = seq.item.input_ids, seq.item.logprob_start_len
        length = len(prompt)
        # logits[j] is position length - kept + j of the (unpadded) prompt
        first = start - (length - kept)
        scored = logits[first : kept - 1]  # predicts prompt[start + 1 :]
        logprobs = scaled_logprobs(scored, [seq.item.params.temperature] * scored.shape[0])
        targets = torch.tensor(prompt[start + 1 :], device=logits.device)
        values = (
            logprobs.gather(1, targets[:, None]).flatten().clamp(min=torch.finfo(torch.float32).min)
        )
        input_lp: list[float | None] = [None, *values.tolist()]
        input_top: list[TopLogprobs | None] | None = None
        k = seq.item.top_logprobs_num
        if k:
            input_top = [None, *(top_logprobs(row, k) for row in logprobs)]
        return input_lp, input_top

    # ----- weights --------------------------------------------------------------------------

    @torch.inference_mode()
    def load_weights(self, path: str) -> None:
        """Replace the weights in place from an HF directory (safetensors or .bin)."""
        tensors = _read_checkpoint(path)
        # with LoRA: the base tensors only; loaded adapters stay and apply to the new base
        state = self.lora.base_state() if self.lora is not None else self.model.state_dict()
        problems = []
        for name, tensor in tensors.items():
            if name not in state:
                problems.append(f"unexpected weight {name!r}")
            elif tuple(tensor.shape) != tuple(state[name].shape):
                problems.append(
                    f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model "
                    f"{tuple(state[name].shape)}"
                )
        provided = {state[n].data_ptr() for n in tensors if n in state}
        missing = [n for n in state if n not in tensors and state[n].data_ptr() not in provided]
        if missing:
            problems.append(f"missing weights {missing[:5]}")
        if problems:
            raise WeightLoadError(
                f"Failed to update weights: {'; '.join(problems[:5])}.\n"
                "Rolling back to original weights."
            )
        for name, tensor in tensors.items():
            state[name].copy_(tensor.to(device=self.device, dtype=state[name].dtype))


def _read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    directory = Path(path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files and directory.is_dir():
        files = sorted(directory.glob("pytorch_model*.bin"))
    if not files:
        reason = "repository not found" if not directory.exists() else "no weight files found"
        raise WeightLoadError(f"Failed to get weights iterator: {path} ({reason}).")
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / n for n in names]
    tensors: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            if f.suffix == ".safetensors":
                tensors.update(load_file(str(f)))
            else:
                tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    except Exception as exc:
        raise WeightLoadError(f"Failed to get weights iterator: {path} ({exc}).") from exc
    return tensors
