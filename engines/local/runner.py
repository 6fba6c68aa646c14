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
- Prompt logprobs (`return_logprob`) are read from the logits of the kept positions
  `input_logprob_chunk` (1,024) positions at a time (sampling.input_logprobs): one chunk's
  float32 [positions x vocab] at a time, not the prompt's; the logits stay in the model dtype.
- `load_weights` validates every tensor (names, shapes) before copying any, so a failed update
  leaves the old weights in place.
- With LoRA (`enable_lora`, lora_runner.py) every forward passes each row's adapter through
  peft's `adapter_names`, so base and adapter rows share the batch and its KV cache; identical
  prompts share a prefill only when they also share the adapter. A base weight update
  replaces the base tensors and keeps the adapters.

- Prefix cache (prefix_cache.py): a prefill first looks up each prompt's longest cached
  prefix in its namespace (weight generation, `extra_key`, LoRA adapter load), at most
  SGLang's `max_prefix_len`
  (prompt length - 1, and not past `logprob_start_len` when input logprobs are asked for), and
  computes only the suffix: the batch's past KV holds each row's cached prefix, left-padded,
  and the suffixes follow, left-padded too (padding in the middle is masked, positions count
  real tokens only). The prompt's KV is inserted after its prefill, and a finished request's
  prompt + output KV when its row leaves the batch, under the namespace of its prefill. Every
  weight load starts a new generation of the cache (and each adapter load a new adapter id):
  KV computed before it is neither reused nor inserted after it, whatever the pause mode and
  whatever `extra_key` a request carries (none, or one from before the pause).
  `cached_tokens` is the matched length (SGLang's `pre_len` at the first prefill); a
  duplicate prompt prefilled in the same step reports its `max_prefix_len`, as it would once
  the first copy is in the tree.

Not covered: paged memory, chunked prefill of one long prompt, reuse of KV during decode.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Sequence as Seq
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

from .prefix_cache import PrefixCache, cache_prompts, max_prefix_len, prefill_layout
from .sampling import INPUT_LOGPROB_CHUNK, Sampled, input_logprobs, sample
from .sequence import Prefilled, Sequence, StepOutput
from .weights_io import WeightLoadError, check_tensors, read_checkpoint

__all__ = ["ModelRunner", "WeightLoadError"]

logger = logging.getLogger(__name__)

# transformers 5.24 renamed forward's `past_key_values` to `cache` and warns at every call
# (FutureWarning, removal in 5.40); we support transformers>=5.0, where `cache` does not exist
# and would be swallowed by **kwargs (decoding silently without the KV cache). So we keep the
# name every 5.x accepts and silence just that warning; switch to `cache=` when the floor is
# raised to 5.24. A filter here, not `catch_warnings` at the call: the forward runs on a
# worker thread, and `catch_warnings` swaps the process-wide filter list.
warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated",
                        category=FutureWarning)  # fmt: skip

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_int_set(value) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        max_prefix_cache_tokens: int = 0,
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
        self.prefix = PrefixCache(max_prefix_cache_tokens)
        self._row_ns: dict[Sequence, Any] = {}  # cache namespace of each row's prefill
        self.input_logprob_chunk = INPUT_LOGPROB_CHUNK  # prompt positions per fp32 chunk

    # ----- LoRA (lora_runner.py) ------------------------------------------------------------

    def enable_lora(self, max_lora_rank: int, target_modules: Seq[str]) -> None:
        from .lora_runner import LoraAdapters

        self.lora = LoraAdapters(
            self.model, max_lora_rank=max_lora_rank, target_modules=target_modules
        )

    def load_lora(self, name: str, path: str) -> None:
        self.lora.load(name, path)
        self.prefix.adapter_loaded(name)

    def delete_lora(self, name: str) -> None:
        self.lora.delete(name)
        self.prefix.adapter_deleted(name)

    def flush_prefix_cache(self) -> None:
        """Drop the cache; rows still in the batch (finished, retracted) are not cached later."""
        self.prefix.new_generation()

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
        self._row_ns.clear()

    def _retain(self, keep: Seq[Sequence]) -> None:
        """Drop rows not in `keep`, then the left columns that became padding in every row."""
        wanted = set(keep)
        index = [i for i, s in enumerate(self._rows) if s in wanted]
        if len(index) == len(self._rows):
            return
        for i, seq in enumerate(self._rows):
            if seq not in wanted:
                self._cache_finished(i, seq)
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

    def _cache_finished(self, row: int, seq: Sequence) -> None:
        """Insert a finished row's prompt + output KV (not the last token: it has none yet)."""
        ns = self._row_ns.pop(seq, None)
        reason = (seq.finish_reason or {}).get("type")
        if ns is None or reason not in ("stop", "length") or not self.prefix.enabled:
            return
        assert self._cache is not None and self._mask is not None
        tokens = (seq.item.input_ids + seq.output_ids)[:-1]
        cols = self._mask[row].nonzero().flatten()
        if len(cols) != len(tokens):  # not the layout this method assumes: skip, never guess
            return
        kv = [(k[row][:, cols], v[row][:, cols]) for k, v in self._kv(self._cache)]
        self.prefix.insert(ns, tokens, kv)  # not if the weights or adapter changed since

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
        # identical prompts for the same adapter and cache namespace are prefilled once
        unique: dict[tuple[Any, tuple[int, ...]], int] = {}
        row_of = [unique.setdefault((self._namespace(s), tuple(s.prefill_ids)), len(unique))
                  for s in admit]  # fmt: skip
        row_seqs = {r: s for s, r in zip(admit, row_of, strict=True)}  # a sequence per row
        prompts = [list(ids) for _, ids in unique]
        limits = [len(p) - 1 for p in prompts]
        for s, r in zip(admit, row_of, strict=True):
            limits[r] = min(limits[r], max_prefix_len(s))
        spaces = [self._namespace(row_seqs[r]) for r in range(len(prompts))]
        hits = [self.prefix.match(spaces[r], p, limits[r]) for r, p in enumerate(prompts)]
        cache, mask, ids, past = prefill_layout(prompts, hits, self.pad_id, self.device)
        if past:
            cache = self._new_cache(cache)
        else:
            cache = DynamicCache(config=self.model.config)
        keep_last = 1
        for s in admit:
            if s.item.return_logprob and not s.prefilled:
                keep_last = max(keep_last, len(s.item.input_ids) - s.item.logprob_start_len)
        result = self._forward(
            [row_seqs[r] for r in range(len(prompts))],
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, past:],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=keep_last,
        )
        logits = result.logits  # [unique, keep_last, V]
        cache_prompts(self.prefix, spaces, prompts, hits, self._kv(cache), past)
        first_use: set[int] = set()
        for s, r in zip(admit, row_of, strict=True):
            cached = max_prefix_len(s, len(s.prefill_ids) - 1) if r in first_use else hits[r][0]
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
        for s in seqs:
            self._row_ns[s] = self._namespace(s)

    def _input_logprobs(self, seq: Sequence, logits: torch.Tensor, kept: int):
        """Entries for prompt positions start..len-1; entry 0 is None (SGLang's alignment)."""
        prompt, start = seq.item.input_ids, seq.item.logprob_start_len
        first = start - (len(prompt) - kept)  # logits[j] is prompt position len - kept + j
        values, tops = input_logprobs(logits[first : kept - 1], prompt[start + 1 :],
                                      seq.item.top_logprobs_num, self.input_logprob_chunk)  # fmt: skip
        return [None, *values], None if tops is None else [None, *tops]

    # ----- weights --------------------------------------------------------------------------

    @torch.inference_mode()
    def load_weights(self, path: str) -> None:
        """Replace the weights in place from an HF directory (safetensors or .bin)."""
        self.load_tensors(read_checkpoint(path), complete=True)

    @torch.inference_mode()
    def load_tensors(self, tensors: dict[str, torch.Tensor], *, complete: bool = False) -> None:
        """Copy `tensors` into the model, all checked first; `complete`: every weight must be
        there (a checkpoint, not one bucket of a broadcast)."""
        # with LoRA: the base tensors only; loaded adapters stay and apply to the new base
        state = self.lora.base_state() if self.lora is not None else self.model.state_dict()
        check_tensors(tensors, state, complete=complete)
        for name, tensor in tensors.items():
            state[name].copy_(tensor.to(device=self.device, dtype=state[name].dtype))
        # KV computed so far (the cache, rows kept "in_place") is never reused from now
        self.prefix.new_generation()

    def _namespace(self, seq: Sequence) -> Any:
        return self.prefix.namespace(seq.item.extra_key, seq.item.lora_name)
