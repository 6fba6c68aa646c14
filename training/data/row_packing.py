"""Which samples share a packed row: best-fit decreasing (`pack_sequences`) and the
token-balanced variant (`pack_balanced`). Pure functions of the samples' lengths; split from
training/data/packing.py (which re-exports both) to keep it under the module budget.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence

from plumbing.errors import ConfigError
from training.data.tokenize import TokenizedSample


def pack_sequences(samples: Sequence[TokenizedSample], max_tokens_per_row: int) -> list[list[int]]:
    """Assign samples to rows of at most `max_tokens_per_row` tokens, by best-fit decreasing.

    Best-fit decreasing (longest sample first, into the fullest row it fits in; ties by lower
    index) packs about as tightly as first-fit decreasing, is deterministic, and runs in
    O(n log n). Data order is kept where it does not cost efficiency: each row lists its
    samples in index order and rows are ordered by their first sample.

    Args:
        samples: the samples to pack (only their lengths are used).
        max_tokens_per_row: row capacity in tokens.

    Returns:
        Rows of indices into `samples`; every index appears exactly once.

    Raises:
        ConfigError: if a sample is longer than `max_tokens_per_row`.
    """
    lengths = [len(s) for s in samples]
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens_per_row]
    if too_long:
        i = too_long[0]
        raise ConfigError(
            f"max_tokens_per_row={max_tokens_per_row} is shorter than {len(too_long)} sample(s), "
            f"e.g. {samples[i].source or f'sample {i}'} with {lengths[i]} tokens; raise it to at "
            "least max_seq_len"
        )
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, row index), sorted: the best fit is first
    for i in sorted(range(len(samples)), key=lambda i: (-lengths[i], i)):
        k = bisect_left(free, (lengths[i], -1))
        if k == len(free):
            row, left = len(rows), max_tokens_per_row
            rows.append([])
        else:
            left, row = free.pop(k)
        rows[row].append(i)
        if left - lengths[i] > 0:
            insort(free, (left - lengths[i], row))
    return sorted((sorted(r) for r in rows), key=lambda r: r[0])


def pack_balanced(samples: Sequence[TokenizedSample], max_tokens_per_row: int) -> list[list[int]]:
    """Assign samples to the fewest rows that fit, keeping the rows about equally long.

    Batches are padded to their longest row, so for a small batch (one step of short samples)
    equal rows waste far less than filling rows to capacity and leaving a short last one:
    32 samples of 17 tokens in rows of 256 fill 3 rows as 255/255/34 (71 % efficiency) with
    best-fit, but 187/187/170 (97 %) here. Longest sample first onto the currently shortest row;
    if a row would overflow, one more row is added and the assignment redone. Deterministic.

    Args:
        samples: the samples to pack (only their lengths are used).
        max_tokens_per_row: row capacity in tokens.

    Returns:
        Rows of indices into `samples` (each row in index order; rows by first index).

    Raises:
        ConfigError: if a sample is longer than `max_tokens_per_row`.
    """
    lengths = [len(s) for s in samples]
    if not lengths:
        return []
    if max(lengths) > max_tokens_per_row:
        return pack_sequences(samples, max_tokens_per_row)  # raises the named ConfigError
    order = sorted(range(len(samples)), key=lambda i: (-lengths[i], i))
    n_rows = max(1, -(-sum(lengths) // max_tokens_per_row))
    while True:
        heap = [(0, r) for r in range(n_rows)]
        rows: list[list[int]] = [[] for _ in range(n_rows)]
        for i in order:
            used, r = heapq.heappop(heap)
            rows[r].append(i)
            heapq.heappush(heap, (used + lengths[i], r))
        if max(used for used, _ in heap) <= max_tokens_per_row:
            break
        n_rows += 1
    return sorted((sorted(r) for r in rows if r), key=lambda r: r[0])
