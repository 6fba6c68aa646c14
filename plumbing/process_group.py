"""SGLang's `init_custom_process_group`: a process group of its own, outside torchrun's.

Why here: both ends of a distributed weight push build the same group, the trainer's rank 0
(engines/refit.py) and the local engine (engines/local/refit_api.py), and they must agree on
the wire: a TCP store at `tcp://master_address:master_port`, keys under a `PrefixStore` named
after the group, then the backend (gloo on CPU, NCCL on CUDA) built by torch's own helper.
This is SGLang 0.5.23's function (`sglang/srt/utils/common.py`), so a trainer using it can
join a real SGLang server's group. It needs no default process group: a one-process trainer
and a torchrun job's rank 0 both call it the same way.

The rendezvous is bounded by `timeout_s`, every collective on the group by
`collective_timeout_s` (gloo raises after it); a peer that
dies makes the pending collective fail at once ("Connection closed by peer").
"""

from __future__ import annotations

import datetime
from typing import Any

import torch


def init_custom_process_group(*, backend: str, master_address: str, master_port: int,
                              world_size: int, rank: int, group_name: str,
                              timeout_s: float, collective_timeout_s: float | None = None
                              ) -> Any:  # fmt: skip
    """Join (rank 0: host) the group `group_name`; blocks until all `world_size` ranks joined,
    at most `timeout_s` (then raises, naming the store). Each collective on the group is bounded
    by `collective_timeout_s` (default: `timeout_s`)."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    # The store `rendezvous("tcp://...")` builds, made directly: under torchrun that helper
    # makes every rank a client of torchelastic's agent store (TORCHELASTIC_USE_AGENT_STORE), so
    # a trainer's rank 0 would wait for a store nobody hosts at `master_port`.
    store = TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                     timeout=timeout, multi_tenant=True)  # fmt: skip
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    collective = timeout if collective_timeout_s is None else datetime.timedelta(
        seconds=collective_timeout_s)  # fmt: skip
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None,
                                      timeout=collective)  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(group: Any) -> None:
    """Tear `group` down; its peers' pending collectives fail (their sockets close)."""
    torch.distributed.destroy_process_group(group)


def flatten_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """SGLang's `FlattenedTensorBucket`: the tensors' bytes back to back, one uint8 tensor."""
    return torch.cat([t.contiguous().flatten().view(torch.uint8) for t in tensors])


def unflatten_bucket(flat: torch.Tensor, dtypes: list[torch.dtype],
                     shapes: list[list[int]]) -> list[torch.Tensor]:  # fmt: skip
    """The tensors `flatten_bucket` packed (views into `flat`)."""
    out, offset = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        out.append(flat[offset : offset + size].view(dtype).view(shape))
        offset += size
    return out


def bucket_bytes(dtypes: list[torch.dtype], shapes: list[list[int]]) -> int:
    """The size of the flat tensor a bucket of these tensors travels in."""
    return sum(int(torch.Size(s).numel()) * d.itemsize for d, s in zip(dtypes, shapes, strict=True))
