"""The frames between the trainer and its rollout workers: a JSON header and flat buffers.

One frame on the pipe: an 16-byte prefix (magic `RWF1`, header length, buffer length, both
little-endian uint32, and 4 reserved zero bytes), the header (UTF-8 JSON object) and the
buffers, back to back. The header names the buffers it carries (`"buffers": [[dtype, count],
...]`, dtype `int32` or `float32`), so a reader slices them without copying. Never pickle: a
frame is data only, and a worker that dies mid-write leaves a truncated frame, which the reader
refuses naming how many bytes were missing (`FrameError`), as it refuses a frame past
`max_bytes` before reading it.

Groups of samples travel as one frame (`encode_groups` / `decode_groups`): each sample's fields
other than its tokens go in the header (those at their default left out); three flat buffers
carry the tokens, with each sample's lengths in the header: prompt + response token ids (int32),
the loss mask laid out the same way, 0 over the prompt (int32), and the engine logprobs
(float32). The decoded samples hold read-only views of the buffers (`TokenArray`), so a trainer
row (prompt + response ids, mask 0 over the prompt) is a view too: no Python object per token.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import trio

try:  # POSIX: widening a pipe (Linux only, F_SETPIPE_SZ)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from plumbing.errors import DataError, RolloutsError
from plumbing.gc_pause import gc_paused
from rollouts.token_arrays import TokenArray
from rollouts.types import Sample

MAGIC = b"RWF1"
PREFIX = struct.Struct("<4sII4x")
MAX_FRAME_BYTES = 1 << 30  # 1 GiB: a batch of 1,024 x 16 x 2,048 tokens is ~400 MiB
DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4")}
TOKEN_FIELDS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs")


class FrameError(RolloutsError):
    """A frame that cannot be read: truncated, too large, or not a frame."""


def encode_frame(header: Mapping[str, Any], buffers: Sequence[np.ndarray] = ()) -> bytes:
    """One frame: `header` (JSON-serialisable; its "buffers" key is set here) and `buffers`."""
    arrays = [_flat(b) for b in buffers]
    head = dict(header)
    head["buffers"] = [[a.dtype.name, int(a.size)] for a in arrays]
    text = json.dumps(head, separators=(",", ":")).encode()
    payload = b"".join(a.tobytes() for a in arrays)
    return PREFIX.pack(MAGIC, len(text), len(payload)) + text + payload


def _flat(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    for name, dtype in DTYPES.items():
        if array.dtype == dtype or array.dtype.name == name:
            return np.ascontiguousarray(array, dtype=dtype).reshape(-1)
    raise TypeError(f"frame buffers are int32 or float32, got {array.dtype}; convert it first")


class FrameReader:
    """Reads whole frames from a trio receive stream (a worker's stdout, the worker's stdin)."""

    def __init__(self, stream: trio.abc.ReceiveStream, *, max_bytes: int = MAX_FRAME_BYTES,
                 what: str = "the pipe"):  # fmt: skip
        self._stream = stream
        self._pending = bytearray()
        self.max_bytes = max_bytes
        self.what = what
        self._fd = _nonblocking_fd(stream)
        if self._fd is not None:
            _widen_pipe(self._fd)

    async def receive(self) -> tuple[dict[str, Any], list[np.ndarray]] | None:
        """The next frame's (header, buffers); None when the stream ended between frames.

        Raises:
            FrameError: the stream ended inside a frame, the frame is larger than `max_bytes`,
                or the bytes are not a frame (no magic, a header that is not JSON).
        """
        prefix = await self._exactly(PREFIX.size, None)
        if prefix is None:
            return None
        magic, n_header, n_payload = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise FrameError(f"not a rollout-worker frame on {self.what} (starts {magic!r}, "
                             f"not {MAGIC!r}): something else wrote to it (print to stderr "
                             "in a worker, never to stdout)")  # fmt: skip
        size = PREFIX.size + n_header + n_payload
        if size > self.max_bytes:
            raise FrameError(f"oversized frame on {self.what}: {size} bytes, more than the "
                             f"limit of {self.max_bytes}; send fewer groups per request (a "
                             "smaller rollout.batch_size per worker: more rollout.workers)")  # fmt: skip
        body = await self._exactly(n_header + n_payload, size)
        assert body is not None
        return decode_body(body, n_header)

    async def _exactly(self, n: int, frame_size: int | None) -> np.ndarray | None:
        """The next `n` bytes, in a buffer of their own (uint8; each byte copied once, none
        zeroed first: a frame's buffers are views of it)."""
        out, got = np.empty(n, np.uint8), min(n, len(self._pending))
        view = memoryview(out)
        view[:got] = self._pending[:got]
        del self._pending[:got]
        while got < n:
            read = await self._receive_into(view[got:])
            if not read:
                if frame_size is None and not got:
                    return None
                got += PREFIX.size if frame_size is not None else 0
                raise FrameError(
                    f"truncated frame on {self.what}: the stream ended after {got} of "
                    f"{frame_size if frame_size is not None else PREFIX.size} bytes (the "
                    "writer died mid-frame)"
                )
            got += read
        return out

    async def _receive_into(self, view: memoryview) -> int:
        """Read at most `len(view)` bytes into `view`; 0 when the stream ended.

        A pipe's non-blocking descriptor (trio's FdStream) is read straight into `view`,
        without an intermediate bytes object per read (~1 MB each, freshly mapped: a copy and
        page faults per megabyte of a frame); any other stream through `receive_some`.
        """
        if self._fd is None:
            chunk = await self._stream.receive_some(min(max(len(view), 65536), 1 << 20))
            take = min(len(chunk), len(view))
            view[:take] = memoryview(chunk)[:take]
            self._pending += chunk[take:]
            return take
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return os.readv(self._fd, [view])
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._fd)
            except OSError as err:  # as FdStream.receive_some reports it
                error = trio.ClosedResourceError if err.errno == errno.EBADF else \
                    trio.BrokenResourceError  # fmt: skip
                raise error(f"reading {self.what}: {err}") from err


def _nonblocking_fd(stream: object) -> int | None:
    """The descriptor of a trio FdStream (a pipe to or from a process), else None."""
    if not isinstance(stream, getattr(trio.lowlevel, "FdStream", ())):  # (not on Windows)
        return None
    fd = stream.fileno()
    return fd if not os.get_blocking(fd) else None


def _widen_pipe(fd: int) -> None:
    """Let a pipe hold 1 MiB (Linux's default is 64 KiB): a 30 MB frame then wakes the reader
    ~30 times instead of ~470 (each wake-up costs trio tens of microseconds of CPU)."""
    if fcntl is not None and hasattr(fcntl, "F_SETPIPE_SZ"):
        with contextlib.suppress(OSError):  # not a pipe, or above the system's limit
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)


def decode_frame(data: bytes, *, max_bytes: int = MAX_FRAME_BYTES
                 ) -> tuple[dict[str, Any], list[np.ndarray]]:  # fmt: skip
    """Inverse of `encode_frame` for one frame held in memory (exactly one, nothing after)."""
    if len(data) < PREFIX.size:
        raise FrameError(f"truncated frame: {len(data)} bytes, less than the "
                         f"{PREFIX.size}-byte prefix")  # fmt: skip
    magic, n_header, n_payload = PREFIX.unpack(data[: PREFIX.size])
    if magic != MAGIC:
        raise FrameError(f"not a rollout-worker frame (starts {magic!r}, not {MAGIC!r})")
    size = PREFIX.size + n_header + n_payload
    if size > max_bytes:
        raise FrameError(f"oversized frame: {size} bytes, more than the limit of {max_bytes}")
    if len(data) != size:
        what = "truncated" if len(data) < size else "trailing bytes after"
        raise FrameError(f"{what} frame: {len(data)} bytes for a frame of {size}")
    return decode_body(data[PREFIX.size :], n_header)


def decode_body(body: bytes | np.ndarray, n_header: int
                ) -> tuple[dict[str, Any], list[np.ndarray]]:  # fmt: skip
    """(header, read-only buffer views of `body`) of a frame's body (what follows the prefix)."""
    try:
        with gc_paused(n_header >= 1 << 16):  # many acyclic objects (plumbing/gc_pause.py)
            header = _loads_header(bytes(memoryview(body)[:n_header]))
    except ValueError as err:
        raise FrameError(f"frame header is not JSON: {err}") from err
    buffers, offset = [], n_header
    for name, count in header.get("buffers", []):
        dtype = DTYPES.get(name)
        if dtype is None:
            raise FrameError(f"frame buffer dtype {name!r} is not one of {sorted(DTYPES)}")
        end = offset + dtype.itemsize * count
        if end > len(body):
            raise FrameError(f"frame buffers overrun the frame: {end} > {len(body)} bytes")
        array = np.frombuffer(body, dtype, count, offset)
        array.flags.writeable = False  # samples hold views of it (TokenArray): never written
        buffers.append(array)
        offset = end
    if offset != len(body):
        raise FrameError(f"frame has {len(body) - offset} bytes its header does not name")
    return header, buffers


def _loads_header(text: bytes) -> Any:
    """JSON, parsed by orjson when it is installed (the `fast` extra: ~2x faster on a header of
    thousands of sample records); Python's json for what orjson refuses (NaN, Infinity)."""
    if _orjson_loads is not None:
        with contextlib.suppress(ValueError):
            return _orjson_loads(text)
    return json.loads(text)


try:  # optional, as in engines/http.py
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - depends on the environment
    _orjson_loads = None


# -- groups of samples ------------------------------------------------------------------------


def encode_groups(groups: Sequence[Sequence[Sample]]) -> tuple[list[list[dict]], list[np.ndarray]]:
    """(per-sample header records, [ids int32, loss_mask int32, logprobs float32]) of `groups`."""
    records: list[list[dict]] = []
    ids: list[Sequence[int]] = []
    masks: list[Sequence[int]] = []
    logprobs: list[Sequence[float]] = []
    for group in groups:
        rows = []
        for s in group:
            row = {k: v for k, v in s.to_dict().items() if not _is_default(k, v)}
            row["n"] = [len(s.prompt_ids), len(s.response_ids), len(s.rollout_logprobs)]
            rows.append(row)
            ids += (s.prompt_ids, s.response_ids)
            masks += (_zeros(len(s.prompt_ids)), s.loss_mask)
            logprobs.append(s.rollout_logprobs)
        records.append(rows)
    return records, [_cat(ids, np.int32), _cat(masks, np.int32), _cat(logprobs, np.float32)]


# A sample's fields at their defaults, as `to_dict` writes them: left out of the header (the
# decoder's `Sample(**fields)` gives them back), a third of its size for plain samples. The
# token fields travel in the buffers.
_DEFAULTS = Sample((), (), ()).to_dict()


def _is_default(key: str, value: Any) -> bool:
    default = _DEFAULTS[key]
    return key in TOKEN_FIELDS or (type(value) is type(default) and value == default)


def _zeros(n: int) -> Sequence[int]:
    return _ZEROS[:n] if n <= len(_ZEROS) else (0,) * n


_ZEROS = (0,) * 4096


def _cat(parts: Sequence[Sequence[Any]], dtype: type) -> np.ndarray:
    n = sum(len(p) for p in parts)
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=dtype, count=n)


def decode_groups(records: Sequence[Sequence[Mapping[str, Any]]], buffers: Sequence[np.ndarray]
                  ) -> list[tuple[Sample, ...]]:  # fmt: skip
    """Inverse of `encode_groups`: the groups, as Samples (what a training batch is made of).

    The token fields are `TokenArray` views of `buffers` (no Python object per token; equal to
    the tuples the worker had); the other fields come from the header.

    Raises:
        DataError: a record has unknown or missing fields, or inconsistent lengths.
        FrameError: the buffers hold more or fewer tokens than the records name.
    """
    ids, masks, logprobs = buffers
    lengths = [row["n"] for rows in records for row in rows]
    n_prompt, n_response, n_logprobs = (sum(n) for n in zip(*lengths, strict=True)) \
        if lengths else (0, 0, 0)  # fmt: skip
    n_ids = n_prompt + n_response
    if (n_ids, n_ids, n_logprobs) != (len(ids), len(masks), len(logprobs)):
        raise FrameError(f"group buffers hold other token counts than their samples name: ids "
                         f"{len(ids)} for {n_ids}, mask {len(masks)} for {n_ids}, logprobs "
                         f"{len(logprobs)} for {n_logprobs}")  # fmt: skip
    rows_lengths = [k for p, r, _ in lengths for k in (p, r)]  # [prompt 0, response 0, ...]
    groups = []
    with gc_paused():  # tens of thousands of acyclic objects (plumbing/gc_pause.py)
        # Views of the buffers, made in one pass each (masks: the response parts)
        id_views = iter(TokenArray.split(ids, rows_lengths))
        masks_it = iter(TokenArray.split(masks, rows_lengths, with_sums=True)[1::2])
        logprobs_it = iter(TokenArray.split(logprobs, [n for *_, n in lengths]))
        for rows in records:
            group = []
            for row in rows:
                record = dict(row)
                del record["n"]
                try:
                    group.append(Sample.from_token_arrays(record, next(id_views), next(id_views),
                                                          next(masks_it), next(logprobs_it)))  # fmt: skip
                except ValueError as exc:
                    raise DataError(f"invalid sample record in a worker's frame: {exc}") from exc
            groups.append(tuple(group))
    return groups
