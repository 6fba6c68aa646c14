"""A dispatch mode that records the most rows of any new float32 tensor of vocabulary width: the
property behind "no [tokens × vocab] fp32 tensor" in the trainer's logprob head
(tests/test_logprob_head.py) and the local engine's chunked prompt logprobs
(tests/test_engine_local_logprob_chunks.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class VocabRows(TorchDispatchMode):
    """Records the most rows of any new float32 tensor whose last dimension is the vocabulary
    (views of an input, e.g. the transposed output weight, are not new)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.most_rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            is_fp32 = isinstance(t, torch.Tensor) and t.dtype == torch.float32
            if is_fp32 and t.dim() >= 1 and t.shape[-1] == self.vocab and _storage(t) not in inputs:
                self.most_rows = max(self.most_rows, t.numel() // self.vocab)
        return out


def _storage(t: Any) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
