"""Exact-logprobs mode of the local engine (`--exact-logprobs`): the sampled tokens' logprobs
recomputed with the trainer's numerics once a request finishes.

Contract:
- Tokens are sampled as always (batched decode, KV cache, prefix cache). When a request that
  asked for logprobs finishes (stop or length), its output logprobs are replaced by
  `scorer(model, prompt, output, temperature=T)`: by default the trainer's own function
  (training/data/exact_scoring.py:score_alone), one full forward, no KV cache, of that
  sequence alone. So the returned logprob of a token depends on nothing but the weights, the
  prompt, the tokens before it and the temperature: not on the other requests in the batch,
  nor on whether its prefix came from the prefix cache. The trainer, scoring each sample alone
  too (`engines.exact_logprobs`), computes the same floats: `logprob_diff_max_abs` is 0.0.
- It runs on the model thread inside the step that finished the request, before the scheduler
  reports it, so no weight update can come between the tokens and their rescoring.
- The cost: one forward of prompt + response per finished request, on the model thread
  (docs/engines.md, "Exact logprobs").
- `python -m engines.local --exact-logprobs` turns on MKL's strict reproducible mode before the
  model loads (plumbing.threads.strict_blas): float32 matrix products then round the same
  wherever their operands sit in memory, as the trainer's FSDP2-gathered weights sit elsewhere.
  An engine opened in a process that already ran matrix products keeps that process's mode.

Not covered (the fast logprobs are returned): aborted requests, streamed chunks before the
last one, input (prompt) logprobs and top-logprobs. Refused at start: LoRA serving (the trainer's
adapter forward is not the engine's).

Why a `module:function` string: engines/ imports nothing from training/ (the layering the
structure test keeps); the scorer is the one extension point that names trainer code, resolved
once here at start-up, as a config file names a reward function.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from .sequence import Sequence as Seq

DEFAULT_SCORER = "training.data.exact_scoring:score_alone"

# (model, prompt ids, output ids, *, temperature) -> one float32 logprob per output id
Scorer = Callable[..., list[float]]


def resolve_scorer(spec: str) -> Scorer:
    """The function `spec` ("module:function") names.

    Raises:
        ValueError: `spec` is malformed or names nothing importable (the message says which).
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--exact-logprobs-scorer {spec!r}: give module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--exact-logprobs-scorer {spec!r} cannot be loaded: {err}") from err
    if not callable(fn):
        raise ValueError(f"--exact-logprobs-scorer {spec!r} is not a function")
    return fn


def wants_rescoring(seq: Seq) -> bool:
    """A finished (stop / length) request that asked for logprobs and sampled tokens."""
    reason = (seq.finish_reason or {}).get("type")
    finished = seq.error is None and reason in ("stop", "length")
    return finished and bool(seq.output_ids) and seq.item.return_logprob


class ExactLogprobs:
    """Rescores finished sequences on the model thread (`__call__`), with `model`'s weights."""

    def __init__(self, model: Any, scorer: Scorer) -> None:
        self.model, self.scorer = model, scorer

    def __call__(self, seqs: Sequence[Seq]) -> list[list[float] | str]:
        """Per sequence: its output tokens' exact logprobs, or the error text if scoring failed
        (the request then fails rather than return logprobs of another kind)."""
        import torch

        out: list[list[float] | str] = []
        with torch.inference_mode():
            for seq in seqs:
                try:
                    values = self.scorer(self.model, seq.item.input_ids, seq.output_ids,
                                         temperature=seq.item.params.temperature)  # fmt: skip
                except Exception as exc:
                    out.append(f"Exact logprob scoring failed: {exc!r}")
                    continue
                out.append([max(v, _MIN_LOGPROB) for v in values])
        return out


_MIN_LOGPROB = -3.4028234663852886e38  # float32 min, as the sampler clamps (JSON has no -inf)
