"""Ending a rank's process groups so that none of their threads outlives them.

Why this is its own step (issue 33). gloo runs each collective on a worker thread of its
process group (`pt_gloo_runloop`; the sockets are served by `gloo_tcp_loop`). That thread drops
its reference to the collective's tensors just after it wakes the caller. When it holds the
last reference to a tensor that Python created, freeing it takes the GIL; if the interpreter is
finalizing by then, taking the GIL ends the thread with a forced unwind, which C++ turns into
`std::terminate` — "terminate called without an active exception", SIGABRT, and torchrun
reports the finished job as failed (and SIGTERMs the other ranks). It needs the thread to be
descheduled in that gap until the interpreter is finalizing, so it is rare and load-dependent.

`destroy_process_group()` alone does not stop those threads: it only unregisters the groups.
The threads are joined by the group's C++ destructor, which runs when the last reference to the
group goes — and three kinds of reference outlived it in a run of this project:
- `torch.distributed.nn.functional` binds `group=group.WORLD` as a default argument when it is
  imported. Imported after `init_process_group` (FSDP and transformers import it), its ten
  functions hold the default group for the life of the process: `import_before_default_group`
  imports it first, when that default is None.
- DTensor's sharding caches keep the `DeviceMesh`es of every sharded model alive, and a mesh
  holds its groups in `_pg_registry`: `end_process_groups` empties those registries once the
  groups are destroyed (a destroyed group has no use).
- this project's own context and the backends of ranks ≥ 1 (FSDP modules hold their group):
  `DistContext.close` drops them first.

`end_process_groups` then collects garbage and returns the gloo threads still alive: none, when
every reference is gone, and the threads were joined while the interpreter was whole. If some
remain (a newer torch caching a group elsewhere, or a caller keeping a sharded model past
`run_rank0`), it says so; ranks ≥ 1, which own their whole process, then end it with
`os._exit` after flushing (see `worker.run_rank0`), so no thread can meet a finalizing
interpreter there.
"""

from __future__ import annotations

import gc
import logging
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger("rollouts.distributed")

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def native_threads() -> list[str]:
    """The names of this process's OS threads (Linux `/proc`; empty where there is none)."""
    names = []
    try:
        tasks = sorted(os.listdir("/proc/self/task"))
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            continue
    return names


def gloo_threads() -> list[str]:
    """The threads of gloo process groups alive in this process."""
    return [name for name in native_threads() if name.startswith(GLOO_THREADS)]


def import_before_default_group() -> None:
    """Import the modules that capture the default group at import time while it is None."""
    import torch.distributed.nn.functional  # noqa: F401


def final_barrier(group: Any, timeout_s: float) -> None:
    """Meet every rank of `group` (gloo) before the groups end, so that no rank closes its
    sockets while another is still in a collective. A rank that does not arrive within
    `timeout_s` is logged, not waited for."""
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s),
                               wait_all_ranks=True)  # fmt: skip
    except RuntimeError as err:
        log.warning("the final barrier failed (%s); ending the process groups anyway", err)


def end_process_groups() -> list[str]:
    """Destroy every process group, release what torch still holds of them, and return the
    gloo threads still alive (empty: all joined). The caller drops its own references first."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _empty_mesh_registries()
    gc.collect()
    alive = gloo_threads()
    if alive:
        log.warning(
            "%d gloo threads outlive the destroyed process groups (%s): something still holds "
            "a group (a sharded model kept past run_rank0's main?)",
            len(alive),
            ", ".join(sorted(set(alive))),
        )
    return alive


def _empty_mesh_registries() -> None:
    """Drop the (destroyed) groups that cached `DeviceMesh`es still hold."""
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        # issubclass on the type: DeviceMesh's metaclass makes isinstance() inspect the object,
        # which warns on some of torch's deprecated module attributes
        if issubclass(type(obj), DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
