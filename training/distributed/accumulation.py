"""Gradient accumulation under FSDP2 without per-micro-batch gathers, casts and reduces.

By default FSDP2 gathers (and, with mixed precision, casts) every parameter in each forward,
frees it after the forward, gathers it again for the backward, and reduce-scatters the
gradients after every backward. An op of several micro-batches therefore pays that per
micro-batch; at world size 1 each gather is a per-parameter cast plus copy, ~60 % of the copy
kernels of an SFT step on the H100 (docs/gpus.md, "Launch counts").

`gathered_for_op` keeps the parameters gathered from the op's first forward to its end;
`before_pass` makes only the op's LAST pass reduce-scatter the gradients and reshard.
Between passes FSDP2 accumulates the unsharded gradients in `reduce_dtype` (fp32 over bf16
params), so at world size 1 the sum is the per-pass one in the same order (bit-identical),
and above it equals the per-pass reduction to float rounding. Every rank runs the same
number of passes (training/backend/rank_ops.py), so every rank's last pass is the same.

The price is memory: each rank holds the gathered params and fp32 unsharded gradients for the
whole op (2 GB of gradients for 0.5B parameters; 32 GB for 8B). `backend.fsdp.
accumulate_unsharded` turns it off.

The op always ends resharded (`finish`), so the optimizer step updates the sharded weights and
the next op gathers them afresh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's `fully_shard` units, root first (empty when it is not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class GatheredOp:
    """The FSDP settings of one multi-pass op (see the module docstring)."""

    def __init__(self, units: list[torch.nn.Module], reshard_after_forward: bool):
        self.units = units
        self.reshard_after_forward = reshard_after_forward

    def before_pass(self, k: int, n_passes: int) -> None:
        """Pass `k` of `n_passes`: only the last one reduces its gradients and reshards."""
        last = k == n_passes - 1
        for unit in self.units:
            unit.set_requires_gradient_sync(last, recurse=False)  # type: ignore[operator]
            unit.set_reshard_after_backward(last, recurse=False)  # type: ignore[operator]

    def finish(self) -> None:
        """Back to FSDP's per-pass defaults, every unit resharded."""
        for k, unit in enumerate(self.units):
            unit.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]
            unit.set_reshard_after_backward(True, recurse=False)  # type: ignore[operator]
            if k > 0:  # the root keeps FSDP's own choice (it never reshards after forward)
                unit.set_reshard_after_forward(self.reshard_after_forward, recurse=False)  # type: ignore[operator]
            unit.reshard()  # type: ignore[operator]


@contextlib.contextmanager
def gathered_for_op(model: torch.nn.Module, *, enabled: bool,
                    reshard_after_forward: bool) -> Iterator[GatheredOp | None]:  # fmt: skip
    """Keep `model`'s FSDP units gathered across the passes of one op (None: not sharded, or
    `enabled` is False, and FSDP runs each pass as configured)."""
    units = fsdp_units(model) if enabled else []
    if not units:
        yield None
        return
    op = GatheredOp(units, reshard_after_forward)
    for unit in units[1:]:
        unit.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
    try:
        yield op
    finally:
        op.finish()
