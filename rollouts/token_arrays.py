"""TokenArray: an immutable sequence of token ids (or per-token values) kept in one numpy array.

Why: a sample's tokens arrive from a rollout worker as flat int32/float32 buffers
(rollouts/workers/frames.py). Turning them into tuples costs one Python object per token in the
trainer process (~0.16 us each, ~3 million per step of 4,096 samples x 768 tokens). A TokenArray
is a read-only view of the buffer instead, and per-token work on it (concatenation, masking,
counting) runs in numpy.

What is guaranteed: it behaves as the tuple of its values where `Sample` and `RLExample` fields
are used as tuples: `len`, indexing (a Python int or float, never a numpy scalar), slicing (a
TokenArray), iteration (Python scalars), `==` / `hash` with tuples (a TokenArray equals the tuple
of the same values and hashes like it, so dict keys and sets mix both), `+` with a tuple or a
TokenArray on either side (a TokenArray), `in`, `count`, `index`. `tolist()` and `np.asarray()`
give its values at C speed.

What is not: it is not a tuple (`isinstance(x, tuple)` is False, `json.dumps` needs `tolist()`,
as `Sample.to_dict` does); like a tuple it never equals a list; ordering (`<`) is not defined.
The array is never written: a view of someone else's buffer is marked read-only, any other
array is copied first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

_new = object.__new__


class TokenArray(Sequence):
    """See the module docstring. `TokenArray(values, dtype=None)`: a copy of `values`."""

    # Its values are _base[_start:_stop] (_base: read-only, 1-D); _array is that view, made on
    # first use (a frame's thousands of segments mostly need only their bounds). _hash, _sum,
    # _nonzero: computed once. _zeros_before: how many values right before it in _base are 0.
    __slots__ = ("_array", "_base", "_hash", "_nonzero", "_start", "_stop", "_sum",
                 "_zeros_before")  # fmt: skip

    def __init__(self, values: Any, dtype: Any = None) -> None:
        array = np.array(values, dtype=dtype)  # a copy: the caller may still write its own
        if array.ndim != 1:
            raise ValueError(f"TokenArray holds one value per token: got shape {array.shape}")
        array.flags.writeable = False
        self._base = self._array = array
        self._start, self._stop = 0, len(array)

    @staticmethod
    def view(array: np.ndarray) -> TokenArray:
        """A TokenArray over `array` itself (1-D, no copy): read-only, or a read-only view."""
        if array.flags.writeable:
            array = array.view()  # mark this view read-only, not the caller's array
            array.flags.writeable = False
        out = _segment(array, 0, len(array))
        out._array = array
        return out

    @staticmethod
    def split(array: np.ndarray, lengths: Sequence[int], *, with_sums: bool = False
              ) -> list[TokenArray]:  # fmt: skip
        """TokenArrays over the consecutive segments of `array` with these `lengths` (views,
        no copy; `array` is marked read-only, or a read-only view of it is used).

        `with_sums`: each segment's `sum()` and `count_nonzero()` are computed here, for all
        in one numpy pass each (a frame's loss masks: trained-token counts), and a segment
        after one of zeros knows it (`with_zeros_before` then needs no check).
        """
        if array.flags.writeable:
            array = array.view()
            array.flags.writeable = False
        out, start = [], 0
        for n in lengths:
            out.append(_segment(array, start, n))
            start += n
        if with_sums:
            sums = segment_sums(array, lengths)
            binary = not len(array) or (array.min() >= 0 and array.max() <= 1)  # a loss mask
            nonzero = (sums if binary else segment_sums(array != 0, lengths)).tolist()
            sums = sums.tolist()
            zeros = 0  # the previous segment's length when it is all zeros
            for piece, total, count, n in zip(out, sums, nonzero, lengths, strict=True):
                piece._sum, piece._nonzero, piece._zeros_before = total, count, zeros
                zeros = n if not count else 0
        return out

    def joined(self, other: TokenArray) -> TokenArray:
        """`self + other`: a view of their buffer when `other` follows `self` in it (a frame's
        prompt and response ids, from `split`), else a copy."""
        if self._base is other._base and self._stop == other._start:
            return _segment(self._base, self._start, other._stop - self._start)
        return self + other

    def with_zeros_before(self, n: int) -> TokenArray:
        """`(0,) * n + self`: a view of its buffer when the `n` values before it there are
        zeros (a frame's loss mask, zero over the prompt), else a copy."""
        base, start = self._base, self._start
        if start >= n and (getattr(self, "_zeros_before", 0) >= n
                           or not np.count_nonzero(base[start - n : start])):  # fmt: skip
            out = _segment(base, start - n, self._stop - start + n)
            for known in ("_sum", "_nonzero"):  # the zeros add nothing to either
                if hasattr(self, known):
                    setattr(out, known, getattr(self, known))
            return out
        return TokenArray.view(np.concatenate([np.zeros(n, base.dtype), self.array]))

    @property
    def array(self) -> np.ndarray:
        """The values as a read-only 1-D numpy array (no copy)."""
        try:
            return self._array
        except AttributeError:
            self._array = self._base[self._start : self._stop]
            return self._array

    def tolist(self) -> list:
        return self.array.tolist()

    def sum(self) -> Any:
        """The sum of the values, as a Python number (computed once: the array never changes).

        Exact for integers (a loss mask's sum is its trained-token count); floats are summed
        in the array's dtype, as numpy does.
        """
        try:
            return self._sum
        except AttributeError:
            self._sum = self.array.sum().item()
            return self._sum

    def count_nonzero(self) -> int:
        """How many values are not 0 (computed once, like `sum`)."""
        try:
            return self._nonzero
        except AttributeError:
            self._nonzero: int = np.count_nonzero(self.array)
            return self._nonzero

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.array
        if dtype is None or np.dtype(dtype) == array.dtype:
            return array.copy() if copy else array
        return array.astype(dtype)

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return TokenArray.view(self.array[index])  # read-only like its base
        return self.array.item(index)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.array.tolist())

    def __contains__(self, value: object) -> bool:
        return value in self.array.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenArray):
            return len(self) == len(other) and bool(np.array_equal(self.array, other.array))
        if isinstance(other, tuple):
            return len(other) == len(self) and tuple(self.array.tolist()) == other
        return NotImplemented

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:  # first call: computed once (as the tuple's: they mix in dicts)
            self._hash: int = hash(tuple(self.array.tolist()))
            return self._hash

    def __add__(self, other: object) -> TokenArray:
        if not isinstance(other, TokenArray | tuple):
            return NotImplemented
        if not len(other):
            return self
        if not len(self):
            return other if isinstance(other, TokenArray) else TokenArray(other)
        return TokenArray.view(np.concatenate([self.array, np.asarray(other)]))

    def __radd__(self, other: object) -> TokenArray:
        if not isinstance(other, tuple):
            return NotImplemented
        if not other:
            return self
        if not len(self):
            return TokenArray(other)
        return TokenArray.view(np.concatenate([np.asarray(other), self.array]))

    def __reduce__(self) -> tuple[Any, ...]:
        return TokenArray, (self.array,)

    def __repr__(self) -> str:
        return f"TokenArray({self.array.tolist()!r})"


def _segment(base: np.ndarray, start: int, n: int) -> TokenArray:
    """A TokenArray over `base[start:start + n]` (`base` read-only); its view made when used."""
    out = _new(TokenArray)
    out._base, out._start, out._stop = base, start, start + n
    return out


def segment_sums(values: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
    """The sums (int64) of the consecutive segments of `values` with these `lengths`, which
    cover `values` exactly; an empty segment sums to 0."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.zeros(len(lengths), dtype=np.int64)
    nonempty = lengths > 0
    if nonempty.any():  # reduceat sums [start_k, start_k+1): the empty segments are skipped
        starts = (np.cumsum(lengths) - lengths)[nonempty]
        out[nonempty] = np.add.reduceat(values, starts, dtype=np.int64)
    return out
