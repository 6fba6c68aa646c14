"""Rows → ranks: each rank gets a token-balanced share of a backend operation's samples.

Samples that must be scored together stay on one rank: a run sharing one prompt row (prefix
sharing) and a `unit` (a DPO pair) — the blocks of `row_blocks`. With packing (SFT) every
sample is its own block. Blocks go largest first to the rank with the fewest tokens so far
(ties: the lower rank); each rank keeps its samples in their original order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from training.data.prefix_sharing import row_blocks


def rank_shares(samples: Sequence[Any], world: int, *, packed: bool) -> list[list[int]]:
    """Indices into `samples` for each of `world` ranks (some may be empty)."""
    if packed:
        blocks = [([i], len(s)) for i, s in enumerate(samples)]
    else:
        starts = row_blocks(samples)
        ends = [start for start, _ in starts[1:]] + [len(samples)]
        blocks = [
            (list(range(start, end)), sum(widths))
            for (start, widths), end in zip(starts, ends, strict=True)
        ]
    load = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for indices, tokens in sorted(blocks, key=lambda b: (-b[1], b[0][0])):
        rank = min(range(world), key=lambda r: (load[r], r))
        shares[rank].extend(indices)
        load[rank] += tokens
    return [sorted(share) for share in shares]


def even_shares(n: int, world: int) -> list[list[int]]:
    """Indices 0..n-1 cut into `world` contiguous shares whose sizes differ by at most one
    (prompts to decode: concatenating the ranks' answers restores their order)."""
    bounds = [k * n // world for k in range(world + 1)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
