"""The command channel between rank 0 and the other ranks: a JSON codec and gloo transport.

Nothing is pickled. A message is JSON; what JSON lacks is tagged:
- tensors: raw bytes (base64) + dtype + shape;
- dataclasses (samples, batches' rows) and pydantic models (configs): their import path and
  fields;
- callables (loss functions, collate functions, model builders): a module-level function or
  class by import path, or a `functools.partial` of one with encodable arguments. A lambda or a
  closure cannot cross processes: `encode` raises a TypeError naming it, with the fix;
- backends: by the id every rank gave them.

Transport: `broadcast_bytes` (rank 0 → all) and `send_bytes` / `recv_bytes` (point to point),
all on the context's gloo command group, so they work the same whether training uses gloo or
NCCL; each takes an optional deadline shorter than the group's.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel


class SentById:
    """Base of objects every rank builds under the same id (the backends): sent as that id.

    Why a base class here rather than a check for the backend's class: the backend sits above
    this module (it sends its ops through it), so the codec must not import it.
    """

    backend_id: int


def _qualified(obj: Any) -> str:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or "<" in qualname or module == "__main__":
        raise TypeError(
            f"{obj!r} cannot be sent to the other ranks: under torchrun every callable a backend "
            "uses (loss, collate, model builder, update rule) must be a module-level function or "
            "class, or a functools.partial of one (not a lambda, closure or __main__ function)"
        )
    return f"{module}:{qualname}"


def _resolve(path: str) -> Any:
    module, qualname = path.split(":", 1)
    obj: Any = importlib.import_module(module)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return obj


def encode(obj: Any) -> Any:
    """`obj` as a JSON-able structure (see the module docstring for what is supported)."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v) for v in obj]}
    if isinstance(obj, dict):
        return {"__dict__": [[encode(k), encode(v)] for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": base64.b64encode(raw).decode(), "dtype": str(t.dtype)[6:],
                "shape": list(t.shape)}  # fmt: skip
    if isinstance(obj, Path):
        return {"__path__": str(obj)}
    if isinstance(obj, SentById):
        return {"__backend__": obj.backend_id}
    if isinstance(obj, BaseModel):
        return {"__pydantic__": _qualified(type(obj)), "data": obj.model_dump(mode="json")}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__dataclass__": _qualified(type(obj)), "fields": fields}
    if isinstance(obj, functools.partial):
        return {"__partial__": encode(obj.func), "args": encode(obj.args),
                "kwargs": encode(obj.keywords)}  # fmt: skip
    if callable(obj):
        return {"__callable__": _qualified(obj)}
    raise TypeError(f"cannot send a {type(obj).__name__} to the other ranks: {obj!r}")


def decode(data: Any, backends: dict[int, Any] | None = None) -> Any:
    """Inverse of `encode`; `backends` maps the ids of backends to this rank's objects."""
    if isinstance(data, list):
        return [decode(v, backends) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tuple__" in data:
        return tuple(decode(v, backends) for v in data["__tuple__"])
    if "__dict__" in data:
        return {decode(k, backends): decode(v, backends) for k, v in data["__dict__"]}
    if "__tensor__" in data:
        dtype = getattr(torch, data["dtype"])
        raw = base64.b64decode(data["__tensor__"])
        if not raw:
            return torch.empty(data["shape"], dtype=dtype)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
        return flat.reshape(data["shape"])
    if "__path__" in data:
        return Path(data["__path__"])
    if "__backend__" in data:
        return (backends or {})[data["__backend__"]]
    if "__pydantic__" in data:
        return _resolve(data["__pydantic__"]).model_validate(data["data"])
    if "__dataclass__" in data:
        cls = _resolve(data["__dataclass__"])
        fields = {k: decode(v, backends) for k, v in data["fields"].items()}
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        obj = cls(**{k: v for k, v in fields.items() if k in init})
        for k, v in fields.items():
            if k not in init:
                object.__setattr__(obj, k, v)
        return obj
    if "__partial__" in data:
        return functools.partial(decode(data["__partial__"], backends),
                                 *decode(data["args"], backends),
                                 **decode(data["kwargs"], backends))  # fmt: skip
    if "__callable__" in data:
        return _resolve(data["__callable__"])
    raise ValueError(f"unknown tagged value on the command channel: {sorted(data)}")


def dumps(obj: Any) -> bytes:
    return json.dumps(encode(obj), separators=(",", ":")).encode()


def loads(raw: bytes, backends: dict[int, Any] | None = None) -> Any:
    return decode(json.loads(raw), backends)


# -- transport (gloo command group) -------------------------------------------------------------


def _wait(work: Any, timeout_s: float | None) -> None:
    """Wait for an async op; past `timeout_s` raise RuntimeError("... timed out ...") (None:
    the group's own deadline)."""
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timeout=timedelta(seconds=timeout_s))


def broadcast_bytes(raw: bytes | None, group: Any, timeout_s: float | None = None) -> bytes:
    """Rank 0 sends `raw` to every rank of `group`; every rank returns it.

    gloo's sender waits until every receiver has posted its receive: rank 0 passes a
    `timeout_s` so that a rank that stopped answering does not hold it for the command group's
    long deadline (which is for ranks ≥ 1 idling between operations).
    """
    length = torch.tensor([len(raw) if raw is not None else 0], dtype=torch.int64)
    _wait(dist.broadcast(length, src=0, group=group, async_op=True), timeout_s)
    buf = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(int(length.item()), dtype=torch.uint8)
    )
    if buf.numel():
        _wait(dist.broadcast(buf, src=0, group=group, async_op=True), timeout_s)
    return buf.numpy().tobytes()


def send_bytes(raw: bytes, dst: int, group: Any, timeout_s: float | None = None) -> None:
    _wait(dist.isend(torch.tensor([len(raw)], dtype=torch.int64), dst=dst, group=group),
          timeout_s)  # fmt: skip
    if raw:
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        _wait(dist.isend(buf, dst=dst, group=group), timeout_s)


def recv_bytes(src: int, group: Any, timeout_s: float | None = None) -> bytes:
    length = torch.empty(1, dtype=torch.int64)
    _wait(dist.irecv(length, src=src, group=group), timeout_s)
    buf = torch.empty(int(length.item()), dtype=torch.uint8)
    if buf.numel():
        _wait(dist.irecv(buf, src=src, group=group), timeout_s)
    return buf.numpy().tobytes()
