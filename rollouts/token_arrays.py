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

    # _base, _start: the buffer this is a segment of, and where (set by `split`)
    # _zeros_before: how many values right before it in _base are known to be 0
    __slots__ = ("_array", "_base", "_hash", "_nonzero", "_start", "_sum", "_zeros_before")

    def __init__(self, values: Any, dtype: Any = None) -> None:
        array = np.array(values, dtype=dtype)  # a copy: the caller may still write its own
        if array.ndim != 1:
            raise ValueError(f"TokenArray holds one value per token: got shape {array.shape}")
        array.flags.writeable = False
        self._array = array

    @staticmethod
    def view(array: np.ndarray) -> TokenArray:
        """A TokenArray over `array` itself (1-D, no copy): read-only, or a read-only view."""
        if array.flags.writeable:
            array = array.view()  # mark this view read-only, not the caller's array
            array.flags.writeable = False
        out = _new(TokenArray)
        out._array = array  # a slice of a read-only array is read-only: no copy, no check
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
        base = getattr(self, "_base", None)
        if base is not None and base is getattr(other, "_base", None) and \
                self._start + len(self._array) == other._start:  # fmt: skip
            return _segment(base, self._start, len(self._array) + len(other._array))
        return self + other

    def with_zeros_before(self, n: int) -> TokenArray:
        """`(0,) * n + self`: a view of its buffer when the `n` values before it there are
        zeros (a frame's loss mask, zero over the prompt), else a copy."""
        base, start = getattr(self, "_base", None), getattr(self, "_start", 0)
        if base is not None and start >= n and (getattr(self, "_zeros_before", 0) >= n or
                                                not np.count_nonzero(base[start - n : start])):  # fmt: skip
            return _segment(base, start - n, n + len(self._array))
        return TokenArray.view(np.concatenate([np.zeros(n, self._array.dtype), self._array]))

    @property
    def array(self) -> np.ndarray:
        """The values as a read-only 1-D numpy array (no copy)."""
        return self._array

    def tolist(self) -> list:
        return self._array.tolist()

    def sum(self) -> Any:
        """The sum of the values, as a Python number (computed once: the array never changes).

        Exact for integers (a loss mask's sum is its trained-token count); floats are summed
        in the array's dtype, as numpy does.
        """
        try:
            return self._sum
        except AttributeError:
            self._sum = self._array.sum().item()
            return self._sum

    def count_nonzero(self) -> int:
        """How many values are not 0 (computed once, like `sum`)."""
        try:
            return self._nonzero
        except AttributeError:
            self._nonzero: int = np.count_nonzero(self._array)
            return self._nonzero

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if dtype is None or np.dtype(dtype) == self._array.dtype:
            return self._array.copy() if copy else self._array
        return self._array.astype(dtype)

    def __len__(self) -> int:
        return self._array.shape[0]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            out = _new(TokenArray)
            out._array = self._array[index]  # read-only like its base
            return out
        return self._array.item(index)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._array.tolist())

    def __contains__(self, value: object) -> bool:
        return value in self._array.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenArray):
            a, b = self._array, other._array
            return a.shape == b.shape and bool(np.array_equal(a, b))
        if isinstance(other, tuple):
            return len(other) == len(self) and tuple(self._array.tolist()) == other
        return NotImplemented

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:  # first call: computed once (as the tuple's: they mix in dicts)
            self._hash: int = hash(tuple(self._array.tolist()))
            return self._hash

    def __add__(self, other: object) -> TokenArray:
        if not isinstance(other, TokenArray | tuple):
            return NotImplemented
        if not len(other):
            return self
        if not len(self):
            return other if isinstance(other, TokenArray) else TokenArray(other)
        return TokenArray.view(np.concatenate([self._array, np.asarray(other)]))

    def __radd__(self, other: object) -> TokenArray:
        if not isinstance(other, tuple):
            return NotImplemented
        if not other:
            return self
        if not len(self):
            return TokenArray(other)
        return TokenArray.view(np.concatenate([np.asarray(other), self._array]))

    def __reduce__(self) -> tuple[Any, ...]:
        return TokenArray, (self._array,)

    def __repr__(self) -> str:
        return f"TokenArray({self._array.tolist()!r})"


def _segment(base: np.ndarray, start: int, n: int) -> TokenArray:
    """A TokenArray over `base[start:start + n]` (`base` read-only), knowing where it lies."""
    out = _new(TokenArray)
    out._array = base[start : start + n]
    out._base, out._start = base, start
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
