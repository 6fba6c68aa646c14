"""The process-group context of a torchrun job, the device of this rank, and FSDP2 sharding.

`init_distributed(backend_config)` reads `WORLD_SIZE` / `RANK` / `LOCAL_RANK` (set by torchrun):
world size 1 returns None and nothing is initialised (unless `fsdp.at_world_size_1`: then a
group of one, so one GPU runs the sharded code path). Otherwise it creates the training group
(NCCL on CUDA, gloo on CPU) whose collectives time out after `backend.collective_timeout_s`
(reported by training/distributed/watchdog.py), and a
gloo group for the command channel (rank 0 → others), whose waits time out after
`fsdp.command_timeout_s` (a worker idles there while rank 0 generates rollouts).

Rank 0 runs every backend operation of every backend on ONE thread (`DistContext.executor`),
which is the only place that issues collectives, so all ranks see them in the same order.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from plumbing.errors import ConfigError
from training.distributed import liveness, watchdog
from training.distributed.teardown import (
    end_process_groups,
    final_barrier,
    import_before_default_group,
)

if TYPE_CHECKING:
    from training.config import BackendConfig, FSDPConfig

log = logging.getLogger("rollouts.distributed")


@dataclass
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    group: Any  # training collectives (FSDP, loss normaliser, grad norm, DCP)
    commands: Any  # gloo group of the command channel
    fsdp: FSDPConfig
    executor: ThreadPoolExecutor | None = None  # rank 0: the one thread that issues collectives
    backends: dict[int, Any] = field(default_factory=dict)
    next_id: int = 0
    collective_timeout_s: float = 120.0  # the training group's deadline (watchdog messages)

    def register(self, backend: Any, backend_id: int | None = None) -> int:
        """Give `backend` the next id (rank 0) or the id rank 0 gave it (ranks ≥ 1)."""
        if backend_id is None:
            backend_id = self.next_id
        self.next_id = max(self.next_id, backend_id + 1)
        self.backends[backend_id] = backend
        return backend_id

    def unregister(self, backend_id: int) -> None:
        """Forget a closed backend (every rank), so that its model and optimizer are freed when
        nothing else holds them, not at the job's end."""
        self.backends.pop(backend_id, None)

    def close(self) -> list[str]:
        """End this rank's part of the job; returns the gloo threads still alive (empty: every
        process group was destroyed and its threads joined; see training/distributed/teardown.py).
        """
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        if self.commands is not None:
            final_barrier(self.commands, self.fsdp.shutdown_timeout_s)
        # Our own references to the groups go first: the backends' FSDP modules hold them.
        self.backends.clear()
        self.group = self.commands = None
        return end_process_groups()


_CURRENT: DistContext | None = None


def current() -> DistContext | None:
    """The context of this process, or None at world size 1 (plain `python`)."""
    return _CURRENT


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_worker_rank() -> bool:
    """True on ranks ≥ 1 of a torchrun job (they run `serve_commands`, not the recipe)."""
    return int(os.environ.get("RANK", "0")) > 0


def init_distributed(backend: BackendConfig) -> DistContext | None:
    """Join the torchrun job described by the environment (idempotent); None at world size 1."""
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    world = world_size_from_env()
    if world == 1 and not backend.fsdp.at_world_size_1:
        return None
    missing = [
        k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} but {', '.join(missing)} unset: launch with torchrun"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = _rank_device(backend.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fsdp = backend.fsdp
    import_before_default_group()  # else it holds the default group for good (teardown.py)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=timedelta(seconds=backend.collective_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    commands = dist.new_group(backend="gloo", timeout=timedelta(seconds=fsdp.command_timeout_s))
    executor = (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer") if rank == 0 else None
    )
    _CURRENT = DistContext(rank, world, local_rank, device, dist.group.WORLD, commands, fsdp,
                           executor, collective_timeout_s=backend.collective_timeout_s)  # fmt: skip
    watchdog.set_status(_CURRENT, {"op": "starting", "step": None, "phase": None})
    liveness.record_process(_CURRENT)
    log.info("rank %d of %d on %s (%s)", rank, world, device, dist.get_backend())
    return _CURRENT


def shutdown_distributed() -> list[str]:
    """End the job's process groups on this rank; returns the gloo threads still alive."""
    global _CURRENT
    if _CURRENT is None:
        return []
    ctx, _CURRENT = _CURRENT, None
    return ctx.close()


def _rank_device(configured: str, local_rank: int) -> torch.device:
    """`cuda` means this rank's GPU (LOCAL_RANK); `cpu` stays `cpu`."""
    dev = torch.device(configured)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"backend.device={configured!r} but CUDA is not available")
        return torch.device("cuda", local_rank)
    return dev


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF model (`model.model.layers` and its kin): FSDP's units."""
    for path in ("model.layers", "model.model.layers", "transformer.h", "gpt_neox.layers",
                 "model.decoder.layers", "base_model.model.model.layers"):  # fmt: skip
        obj: Any = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
            return list(obj)
    raise ConfigError(
        f"cannot find the decoder layers of {type(model).__name__} to shard with fully_shard "
        "(looked for model.layers, transformer.h, gpt_neox.layers, model.decoder.layers)"
    )


def shard_model(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """`fully_shard` each decoder layer, then the root, as `ctx.fsdp` says (in place).

    Gradients are SUM-reduced (divide factor 1): the backend normalises the loss by the global
    token or sequence count before backward, so the summed gradient is the one-process one.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

    cfg = ctx.fsdp
    kwargs: dict[str, Any] = {"reshard_after_forward": cfg.reshard_after_forward}
    if cfg.param_dtype != "float32" or cfg.reduce_dtype != "float32":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, cfg.param_dtype),
            reduce_dtype=getattr(torch, cfg.reduce_dtype),
        )
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(model)
    if cfg.activation_checkpointing:
        _checkpoint_layers(model)
    if cfg.compile_layers:
        compile_layers(layers)
    for layer in layers:
        fully_shard(layer, mesh=None, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():  # the setting is per FSDP unit, not inherited
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if ctx.device.type == "cpu":  # gloo has no PREMUL_SUM; a plain SUM is what we want
                module.set_force_sum_reduction_for_comms(True)
    return model


def compile_layers(layers: list[torch.nn.Module], backend: str = "inductor") -> None:
    """`torch.compile` each decoder layer in place (torchtitan's `apply_compile`): Inductor fuses
    its norms, RoPE, SwiGLU, residual adds and casts into a few kernels. Shapes are dynamic, so
    micro-batches of other sizes do not recompile; FSDP's hooks stay outside the graphs.
    `backend`: another Dynamo backend (the tests trace with "eager")."""
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)


def _checkpoint_layers(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (HF's own switch)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"{type(model).__name__} does not support activation checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
