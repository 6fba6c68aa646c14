"""The model's weights in buckets of a bounded size, for a broadcast to inference engines.

Why: a distributed weight push (engines/refit.py) sends the weights as a few large broadcasts
instead of one file per push. Under FSDP2 each parameter is gathered whole (`full_tensor()`, a
collective every rank runs in the same order) only when its bucket is sent and dropped after,
so no rank ever holds more than one bucket beyond its own shards, never the model twice.

`plan_buckets` reads metadata only (names, global shapes, dtypes): the engines are told what
each bucket holds before its bytes travel. Tied weights (an embedding shared with the output
layer) are sent once, under the first name; the engine's copy is tied the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bucket:
    """What one broadcast carries: names, dtypes (torch's names, "bfloat16") and shapes."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def plan_buckets(model: torch.nn.Module, bucket_bytes: int) -> list[Bucket]:
    """The model's weights, in state-dict order, cut into buckets of at most `bucket_bytes`
    (a tensor larger than that travels alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    size = 0
    for name, t in _unique_weights(model):
        nbytes = t.numel() * t.element_size()
        if names and size + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(names), tuple(dtypes), tuple(shapes)))
            names, dtypes, shapes, size = [], [], [], 0
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(tuple(t.shape))
        size += nbytes
    if names:
        buckets.append(Bucket(tuple(names), tuple(dtypes), tuple(shapes)))
    return buckets


def gathered_buckets(model: torch.nn.Module, plan: list[Bucket],
                     device: torch.device | str = "cpu") -> Iterator[list[torch.Tensor]]:  # fmt: skip
    """Each bucket's tensors, whole, on `device` (every rank must iterate to the end: the
    gathers are collectives; ranks other than 0 may drop what they get)."""
    state = model.state_dict()
    for bucket in plan:
        yield [_whole(state[name]).to(device) for name in bucket.names]


def _whole(t: torch.Tensor) -> torch.Tensor:
    full: Callable[[], torch.Tensor] | None = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach()


def _unique_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, t in model.state_dict().items():
        local = getattr(t, "_local_tensor", t)
        key = (local.data_ptr(), tuple(t.shape))
        if local.numel() and key in seen:
            continue  # tied to a weight already planned
        seen.add(key)
        yield name, t
