"""The `tinker` SDK's wire formats: protobuf `forward_backward` requests in (zstd or not),
protobuf `ForwardBackwardOutput` and `SampleResponse` out (SDK 0.38.0 refuses JSON for those).

The schema is the SDK's own (`tinker.proto.tinker_public_pb2`), so the two can never drift
apart. Nothing from the wire is unpickled: tensors are raw little-endian bytes read with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROTO = "application/x-protobuf"
# per-datum loss inputs the SDK declares (`Datum._key_to_type`): what a datum may carry
TOKEN_KEYS = ("target_tokens",)


class TinkerRequestError(Exception):
    """A request the server refuses: `status` is the HTTP status of an immediate refusal,
    `category` what the SDK shows for a failed future ("user": the caller's input)."""

    def __init__(self, message: str, status: int = 400, category: str = "user") -> None:
        super().__init__(message)
        self.message, self.status, self.category = message, status, category


@dataclass
class Datum:
    """One decoded `tinker.Datum`: the input tokens and its per-token loss inputs (1-D)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _pb() -> Any:
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


MAX_DECOMPRESSED = 1 << 30  # a zstd body may not inflate past 1 GiB (a decompression bomb)


def decode_body(body: bytes, headers: dict[str, str], limit: int = MAX_DECOMPRESSED) -> bytes:
    """The request body, zstd-decompressed when `Content-Encoding: zstd` says so."""
    if headers.get("content-encoding", "").lower() != "zstd":
        return body
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            raw = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise TinkerRequestError(f"the zstd request body does not decompress: {exc}") from None
    if len(raw) > limit:
        raise TinkerRequestError(f"the zstd request body inflates past {limit} bytes: split "
                                 "the batch into smaller forward_backward calls", status=413)  # fmt: skip
    return raw


_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}


def _tensor(msg: Any, where: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise TinkerRequestError(f"{where}: unsupported tensor dtype {msg.dtype} "
                                 "(send float32 or int64 TensorData)")  # fmt: skip
    shape = list(msg.shape)
    try:
        if msg.WhichOneof("encoding") == "sparse_csr":
            values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
            crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
            if len(shape) != 2:
                raise ValueError(f"a sparse tensor needs a 2-D shape, got {shape}")
            dense = np.zeros(shape, dtype=dtype)
            for row in range(shape[0]):
                dense[row, col[crow[row] : crow[row + 1]]] = values[crow[row] : crow[row + 1]]
            return dense
        array = np.frombuffer(msg.dense, dtype=dtype)
        return array.reshape(shape) if shape else array
    except ValueError as exc:
        raise TinkerRequestError(f"{where}: malformed tensor: {exc}") from None


def parse_forward_backward(raw: bytes) -> FwdBwdRequest:
    """Decode a protobuf `ForwardBackwardRequest` (shapes are checked later, per loss)."""
    from google.protobuf.message import DecodeError

    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise TinkerRequestError(
            f"the forward_backward body is not a ForwardBackwardRequest protobuf ({exc}); "
            "send it with the tinker SDK (Content-Type: application/x-protobuf)"
        ) from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for c, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise TinkerRequestError(
                    f"data[{i}].model_input.chunks[{c}] is a {kind} chunk: this server takes "
                    "text (EncodedTextChunk) only"
                )
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {
            name: _tensor(t, f"data[{i}].loss_fn_inputs[{name!r}]")
            for name, t in d.loss_fn_inputs.items()
        }
        data.append(Datum(tokens, inputs))
    return FwdBwdRequest(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _batched(arrays: list[np.ndarray], dtype: Any, code: int) -> Any:
    flat = [np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in flat])
    data = b"".join(a.tobytes() for a in flat)
    return _pb().BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=code)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]],
                                   metrics: dict[str, float]) -> bytes:  # fmt: skip
    """`ForwardBackwardOutput` as protobuf: one `ArrayRecord` holding every datum's float32
    outputs (`logprobs`, `elementwise_loss`) as batched tensors."""
    pb = _pb()
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        record.fields[name].CopyFrom(
            _batched([o[name] for o in outputs], np.float32, pb.DTYPE_FLOAT32)
        )
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


@dataclass
class SampledSeq:
    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: str  # "stop" | "length"


def encode_sample_response(
    sequences: list[SampledSeq], prompt_logprobs: list[float] | None
) -> bytes:
    """`SampleResponse` as protobuf: tokens int32 bytes, logprobs float32 bytes (NaN where
    the engine has none, e.g. the first prompt token)."""
    pb = _pb()
    msg = pb.SampleResponse()
    for seq in sequences:
        out = msg.sequences.add()
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        out.stop_reason = (
            pb.STOP_REASON_LENGTH if seq.stop_reason == "length" else pb.STOP_REASON_STOP
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
