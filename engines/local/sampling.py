"""Next-token sampling and logprobs for a batch of rows, each with its own parameters.

Follows SGLang's sampler: logit bias and penalties are applied to the raw logits, then the
temperature; the reported logprob of a token is log-softmax of the temperature-scaled logits
(before top-k/top-p/min-p filtering), clamped to the float32 minimum so JSON never sees -inf.
Greedy rows (top_k == 1, which is how temperature 0 arrives) take the argmax. A row whose
distribution has no finite probability (NaN weights, a bias that bans every token) is reported
as an error for that row only.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from .sequence import Sequence, TopLogprobs

_MIN_LOGPROB = torch.finfo(torch.float32).min
INPUT_LOGPROB_CHUNK = 1024  # prompt positions whose float32 logprobs exist at once


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    tops: list[TopLogprobs | None]
    errors: list[str | None]


def _adjust_logits(logits: torch.Tensor, seqs: Seq[Sequence], eos_ids: frozenset[int]) -> None:
    """In-place: logit bias, frequency/presence/repetition penalties, min_new_tokens."""
    vocab = logits.shape[-1]
    for row, seq in enumerate(seqs):
        params = seq.item.params
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], device=logits.device)
            bias = torch.tensor([b for _, b in params.logit_bias], device=logits.device)
            logits[row].index_add_(0, ids, bias.to(logits.dtype))
        if params.has_penalties and seq.output_ids:
            counts = torch.bincount(
                torch.tensor(seq.output_ids, device=logits.device), minlength=vocab
            )[:vocab].to(logits.dtype)
            seen = counts > 0
            if params.repetition_penalty != 1.0:
                penalised = torch.where(
                    logits[row] > 0,
                    logits[row] / params.repetition_penalty,
                    logits[row] * params.repetition_penalty,
                )
                logits[row] = torch.where(seen, penalised, logits[row])
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * seen
        if len(seq.output_ids) < params.min_new_tokens and not params.ignore_eos:
            banned = [t for t in eos_ids | params.stop_token_ids if t < vocab]
            if banned:
                logits[row, banned] = float("-inf")


def _needs_adjust(seq: Sequence) -> bool:
    params = seq.item.params
    return bool(
        params.logit_bias
        or (params.has_penalties and seq.output_ids)
        or len(seq.output_ids) < params.min_new_tokens
    )


def _filtered(probs: torch.Tensor, params: list) -> torch.Tensor:
    """Zero what top-k / top-p / min-p exclude (rows that need none are left as they are)."""
    need = [p.top_k > 1 or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
    if not any(need):
        return probs
    rows = torch.tensor([i for i, n in enumerate(need) if n], device=probs.device)
    sub = [p for p, n in zip(params, need, strict=True) if n]
    vocab = probs.shape[-1]
    sorted_probs, order = probs[rows].sort(-1, descending=True)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in sub], device=probs.device)
    top_p = torch.tensor([p.top_p for p in sub], device=probs.device)
    min_p = torch.tensor([p.min_p for p in sub], device=probs.device)
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    keep = ranks < top_k[:, None]
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]  # mass before the token
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    probs = probs.clone()
    probs[rows] = torch.zeros_like(sorted_probs).scatter(1, order, sorted_probs * keep)
    return probs


def top_logprobs(logprobs_row: torch.Tensor, k: int) -> TopLogprobs:
    values, ids = torch.topk(logprobs_row, k)
    return list(zip(values.clamp(min=_MIN_LOGPROB).tolist(), ids.tolist(), strict=True))


def scaled_logprobs(logits: torch.Tensor, temperatures: Seq[float]) -> torch.Tensor:
    temps = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
    return torch.log_softmax(logits.float() / temps[:, None], dim=-1)


def input_logprobs(scored: torch.Tensor, targets: Seq[int], top_k: int, chunk: int
                   ) -> tuple[list[float], list[TopLogprobs] | None]:  # fmt: skip
    """Prompt logprobs: log-softmax of the raw logits `scored` ([n, V], row i predicting
    `targets[i]`; SGLang 0.5.23 applies no temperature to input logprobs) read at the
    targets, and each row's `top_k` best (None when 0), `chunk` rows at a time.

    Why in chunks: the float32 logprobs of a whole prompt are [prompt tokens x vocab] (~5 GB
    for 8,192 tokens of a 152k vocabulary: a teacher's scoring, `logprob_start_len` 0); only
    one chunk's exist at a time here. Log-softmax, gather and top-k are per row, so the values
    are bit for bit those of the whole prompt at once.
    """
    ids = torch.tensor(list(targets), dtype=torch.long, device=scored.device)
    values: list[float] = []
    tops: list[TopLogprobs] | None = [] if top_k else None
    for at in range(0, len(ids), chunk):
        rows = scored[at : at + chunk]
        logprobs = scaled_logprobs(rows, [1.0] * rows.shape[0])
        picked = logprobs.gather(1, ids[at : at + chunk, None]).flatten()
        values += picked.clamp(min=_MIN_LOGPROB).tolist()
        if tops is not None:
            tops += [top_logprobs(row, top_k) for row in logprobs]
        del logprobs, picked  # freed before the next chunk's are made
    return values, tops


def sample(
    logits: torch.Tensor,
    seqs: Seq[Sequence],
    eos_ids: frozenset[int],
    generator: torch.Generator,
) -> Sampled:
    """Sample one token per row of `logits` ([N, V]) for the sequences `seqs`."""
    logits = logits.float()
    if any(_needs_adjust(s) for s in seqs):
        logits = logits.clone()
        _adjust_logits(logits, seqs, eos_ids)
    params = [s.item.params for s in seqs]
    logprobs = scaled_logprobs(logits, [p.temperature for p in params])
    invalid = torch.isnan(logprobs).any(-1) | ~torch.isfinite(logprobs).any(-1)
    errors: list[str | None] = [None] * len(seqs)
    if bool(invalid.any()):
        for row in invalid.nonzero().flatten().tolist():
            errors[row] = (
                "Sampling failed: the next-token distribution has no finite probability "
                "(NaN weights or a logit_bias that bans every token)."
            )
        logprobs = torch.where(invalid[:, None], torch.zeros_like(logprobs), logprobs)

    tokens = logprobs.argmax(-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy and errors[i] is None]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _filtered(logprobs[rows].exp(), [params[i] for i in sampled_rows])
        picks = torch.empty(len(sampled_rows), dtype=torch.long, device=logits.device)
        shared = [j for j, row in enumerate(sampled_rows) if seqs[row].runner_state is None]
        if shared:  # one draw for every row that uses the engine's generator
            index = torch.tensor(shared, device=logits.device)
            picks[index] = torch.multinomial(probs[index], 1, generator=generator).flatten()
        for j, row in enumerate(sampled_rows):
            own = seqs[row].runner_state  # a request's own `sampling_seed` generator
            if own is not None:
                picks[j] = torch.multinomial(probs[j], 1, generator=own)[0]
        tokens[rows] = picks

    chosen_lp = logprobs.gather(1, tokens[:, None]).flatten().clamp(min=_MIN_LOGPROB)
    tops: list[TopLogprobs | None] = [None] * len(seqs)
    k_max = max(s.item.top_logprobs_num for s in seqs)
    if k_max:
        values, ids = torch.topk(logprobs, k_max, dim=-1)
        values, ids = values.clamp(min=_MIN_LOGPROB).tolist(), ids.tolist()
        for row, seq in enumerate(seqs):
            k = seq.item.top_logprobs_num
            if k:
                tops[row] = list(zip(values[row][:k], ids[row][:k], strict=True))
    return Sampled(tokens.tolist(), chosen_lp.tolist(), tops, errors)
