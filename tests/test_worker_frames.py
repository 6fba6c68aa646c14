"""The rollout workers' frame codec: groups survive the pipe exactly; bad frames are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import trio

from rollouts.types import Sample, ToolCallRecord
from rollouts.workers.frames import (
    FrameError,
    FrameReader,
    decode_frame,
    decode_groups,
    encode_frame,
    encode_groups,
)


def _groups() -> list[tuple[Sample, ...]]:
    logprobs = tuple(float(np.float32(-0.1 * k - 1e-3)) for k in range(5))  # float32-exact
    a = Sample((1, 2, 3), (7, 8, 9, 10, 11), (1, 1, 0, 1, 1), logprobs, response_text="x=é",
               reward=0.5, reward_components={"correct": 1.0}, status="truncated", group_id=3,
               index_in_group=1, sub_index=2, weight_version=4, metadata={"answer": "46"},
               tool_calls=(ToolCallRecord("calc", {"x": 1}, "2", True),), finish_reason="length",
               teacher_logprobs=(-0.5, -1.0, -2.0, -0.25, -4.0))  # fmt: skip
    b = Sample((5,), (), (), error="reward raised", status="failed")
    c = Sample((2**31 - 1, 0), (6,), (1,), (-3.5,))
    return [(a, b), (c,)]


def _pipe(data: bytes, chunk: int = 7) -> FrameReader:
    """A reader over a stream that hands `data` over in small chunks, then ends."""

    class Chunks(trio.abc.ReceiveStream):
        def __init__(self) -> None:
            self.at = 0

        async def receive_some(self, max_bytes=None) -> bytes:
            out = data[self.at : self.at + chunk]
            self.at += len(out)
            return out

        async def aclose(self) -> None:
            pass

    return FrameReader(Chunks(), max_bytes=1 << 20, what="worker 0's stdout")


def test_groups_round_trip_through_a_frame_field_for_field():
    groups = _groups()
    records, buffers = encode_groups(groups)
    frame = encode_frame({"kind": "groups", "groups": records}, buffers)
    header, arrays = decode_frame(frame)
    assert header["kind"] == "groups"
    assert [a.dtype.name for a in arrays] == ["int32", "int32", "float32"]
    assert decode_groups(header["groups"], arrays) == groups


async def test_a_stream_of_frames_reads_back_in_order_then_ends():
    records, buffers = encode_groups(_groups())
    data = encode_frame({"k": 1}) + encode_frame({"groups": records}, buffers) + encode_frame({})
    reader = _pipe(data)
    first = await reader.receive()
    second = await reader.receive()
    third = await reader.receive()
    assert first is not None and first[0]["k"] == 1 and first[1] == []
    assert second is not None and decode_groups(second[0]["groups"], second[1]) == _groups()
    assert third is not None and third[0] == {"buffers": []}
    assert await reader.receive() is None


@pytest.mark.parametrize("cut", [3, 20, -1])
async def test_a_truncated_frame_is_refused_naming_the_missing_bytes(cut):
    records, buffers = encode_groups(_groups())
    frame = encode_frame({"groups": records}, buffers)
    reader = _pipe(frame[:cut])
    with pytest.raises(FrameError, match=r"truncated frame on worker 0's stdout.*of \d+ bytes"):
        await reader.receive()
    with pytest.raises(FrameError, match="truncated frame"):
        decode_frame(frame[:cut])


async def test_an_oversized_frame_is_refused_before_it_is_read():
    frame = encode_frame({"x": "y" * 100}, [np.zeros(300_000, np.int32)])
    reader = _pipe(frame[:16])  # the prefix alone says the size
    with pytest.raises(FrameError, match=r"oversized frame on worker 0's stdout: 1200\d+ bytes, "
                                         r"more than the limit of 1048576"):  # fmt: skip
        await reader.receive()
    with pytest.raises(FrameError, match="oversized"):
        decode_frame(frame, max_bytes=1000)


async def test_bytes_that_are_not_a_frame_are_refused_naming_stdout():
    reader = _pipe(b"hello from a print() in a reward\n")
    with pytest.raises(FrameError, match="not a rollout-worker frame.*stderr"):
        await reader.receive()


def test_only_int32_and_float32_buffers_are_sent():
    with pytest.raises(TypeError, match="int32 or float32"):
        encode_frame({}, [np.zeros(3, np.float64)])


def test_a_reward_that_is_not_a_number_survives_the_frame():
    groups = [(Sample((1,), (2,), (1,), (-0.5,), reward=float("nan")),
               Sample((1,), (3,), (1,), (-0.5,), reward=float("-inf")))]  # fmt: skip
    records, buffers = encode_groups(groups)
    header, arrays = decode_frame(encode_frame({"groups": records}, buffers))
    ((a, b),) = decode_groups(header["groups"], arrays)
    assert math.isnan(a.reward) and b.reward == float("-inf") and a.response_ids == (2,)
