"""Model and optimizer state at any world size: reductions, full and sharded state dicts.

Each function takes the rank's `DistContext` (None at world size 1, where the reductions are
the identity and the "sharded" checkpoint is written by one process) so that the backend has
one code path. Full state dicts come from `torch.distributed.checkpoint.state_dict`, which
gathers FSDP2's DTensor shards (to rank 0's CPU memory: one full copy of the model) and is a
plain `state_dict()` for an unsharded model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from training.distributed.context import DistContext

_FULL = None  # StateDictOptions, built lazily (importing torch.distributed.checkpoint is slow)


def _reduce(value: float, ctx: DistContext | None, op: Any) -> float:
    if ctx is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=op, group=ctx.group)
    return float(t.item())


def all_sum(value: float, ctx: DistContext | None) -> float:
    return _reduce(value, ctx, dist.ReduceOp.SUM)


def agree_counts(n_local: int, weight: float, ctx: DistContext | None) -> tuple[list[int], float]:
    """Every rank's count and the sum of every rank's `weight`, in ONE all-reduce.

    Each rank writes its count into its own slot of a zero vector and its weight into the last
    slot; the summed vector holds every rank's count (so each rank can run up to the largest)
    and the global weight (a loss normaliser). float64 holds integer counts exactly.
    """
    if ctx is None:
        return [n_local], weight
    t = torch.zeros(ctx.world + 1, dtype=torch.float64, device=ctx.device)
    t[ctx.rank] = float(n_local)
    t[-1] = weight
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=ctx.group)
    values = t.tolist()
    return [int(v) for v in values[:-1]], values[-1]


def barrier(ctx: DistContext | None) -> None:
    """Wait for every rank, on the command group: ranks wait here while rank 0 writes files
    (a full HF export can take minutes), which the command group's deadline allows for and the
    training group's `backend.collective_timeout_s` does not."""
    if ctx is not None:
        dist.barrier(group=ctx.commands)


def to_local_scalar(t: torch.Tensor) -> float:
    """A scalar tensor's value; a DTensor (a global norm under FSDP) is made whole first."""
    full = getattr(t, "full_tensor", None)
    return float((full() if full is not None else t).item())


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def lerp_params(dst: torch.nn.Module, src: torch.nn.Module, weight: float) -> None:
    """dst ← (1 − weight)·dst + weight·src, parameter by parameter on each rank's own shards
    (both models sharded alike); weight 1 copies exactly."""
    with torch.no_grad():
        for d, s in zip(dst.parameters(), src.parameters(), strict=True):
            d_local, s_local = _local(d), _local(s)
            if weight == 1.0:
                d_local.copy_(s_local)
            else:
                d_local.mul_(1.0 - weight).add_(s_local, alpha=weight)


def copy_params(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    lerp_params(dst, src, 1.0)


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight, whole, on CPU: on rank 0 under torchrun (a collective: every rank calls
    it; the others get {}), a detached copy at world size 1."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not dist.is_initialized():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Inverse of `full_model_state` (every rank passes the whole state)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    if not dist.is_initialized():
        model.load_state_dict(state)
        return
    set_model_state_dict(model, state, options=_options(full_state_dict=True))


def save_sharded(model: torch.nn.Module, optimizer: Any, out: Path, ctx: DistContext | None,
                 *, with_model: bool, trainable_only: bool = False) -> None:  # fmt: skip
    """The optimizer state (and with `with_model` the model) with `torch.distributed.checkpoint`:
    each rank writes its shards, keyed by parameter name, so any world size can load them.

    A full model's weights stay out (`with_model=False`): the checkpoint's HF export holds
    them, and `load_full_weights` reads them back, so the model is on disk once.
    `trainable_only`: leave out frozen parameters (a LoRA model's base: the model it is built
    from has them, so a checkpoint holds the adapter and its optimizer state only).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    options = _options(ignore_frozen_params=trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd} if with_model else {"optim": optim_sd}
    with warnings.catch_warnings():  # world size 1: "assuming ... a single process" is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(out))


def sharded_holds_model(path: Path) -> bool:
    """Whether the DCP checkpoint at `path` has model weights (LoRA adapters, or a checkpoint
    written before the HF export became the one copy of a full model's weights)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(key.startswith("model.") for key in keys)


def load_sharded(model: torch.nn.Module, optimizer: Any, path: Path, *,
                 trainable_only: bool = False) -> None:  # fmt: skip
    """Inverse of `save_sharded` (same `trainable_only`), at this process's world size (DCP
    reshards): the optimizer, and the model when the checkpoint holds it. Every saved key
    must be loaded: a checkpoint missing one is an error (DCP's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        raise ValueError("load_sharded needs the optimizer (a frozen backend is not resumed)")
    options = _options(ignore_frozen_params=trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)  # creates optim state
    with_model = sharded_holds_model(path)
    state = {"model": model_sd, "optim": optim_sd} if with_model else {"optim": optim_sd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path))
    # Frozen parameters are not in `state` when trainable_only: not strict about those.
    options = _options(strict=not trainable_only)
    if with_model:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)  # fmt: skip
    else:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=options)


def load_full_weights(model: torch.nn.Module, full: dict[str, torch.Tensor] | None,
                      ctx: DistContext | None, *, source: Path) -> None:  # fmt: skip
    """model ← `full`, every weight whole (an HF export read back): at world size 1 directly;
    under torchrun rank 0 passes them and the others None, and each rank receives its shards
    by broadcast (so only rank 0 reads the file and holds a full copy).

    A weight the model ties to another (an output layer tied to the embeddings, which an HF
    export writes once) is filled from the one it is tied to.

    Raises:
        CheckpointError: the names in `full` are not the model's (names `source`).
    """
    from plumbing.errors import CheckpointError

    if full is not None:
        for name, twin in tied_names(model).items():
            if name not in full and twin in full:
                full[name] = full[twin]
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - full.keys()), sorted(full.keys() - expected)
        if missing or unexpected:
            raise CheckpointError(f"the weights in {source} do not match the model: missing "
                                  f"{missing[:5]}, unexpected {unexpected[:5]}")  # fmt: skip
    if ctx is None:
        assert full is not None
        model.load_state_dict(full)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    options = _options(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full if full is not None else {}, options=options)


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name that shares its parameter with an earlier name → that name."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def model_bytes(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Bytes of this rank's parameters (its shards under FSDP); only those with gradients
    when `trainable_only`."""
    return sum(_local(p).numel() * p.element_size() for p in model.parameters()
               if p.requires_grad or not trainable_only)  # fmt: skip


class Mean(NamedTuple):
    """A loss metric that is a mean over `weight` units of one micro-batch (trained tokens,
    sequences, pairs): merged over micro-batches and ranks as Σ value·weight / Σ weight, so
    that it is the value one pass over the whole batch gives. A plain float metric is a mean
    over the loss's own weight (`loss_weight_fn`)."""

    value: float | torch.Tensor
    weight: float | torch.Tensor


def merge_rule(key: str) -> str:
    """How a metric named `key` merges: "max" / "min" for a name with a `max` / `min` word
    (`ratio_max`, `logprob_diff_max_abs`), "sum" for counts and sums (`num_pairs`,
    `n_tokens`, `loss_sum`), otherwise "mean" (weighted)."""
    words = key.split("_")
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "sum" if words[0] in ("n", "num") or words[-1] == "sum" else "mean"


MetricSums = dict[str, list[float]]  # key -> [Σ value·weight, Σ weight] (means) or [value]


def accumulate_metrics(into: MetricSums, metrics: dict[str, Any], loss_weight: float) -> None:
    """Add one micro-batch's metrics into `into` by each one's `merge_rule`; a `Mean` brings
    its own weight, a plain number is weighted by `loss_weight`. JSON-able, so that ranks'
    parts travel to rank 0 and add up there (`combine_metric_sums`)."""
    for key, value in metrics.items():
        if isinstance(value, Mean):
            v, w = float(value.value), float(value.weight)
        elif isinstance(value, int | float):
            v, w = float(value), float(loss_weight)
        else:
            continue
        if merge_rule(key) == "mean":
            _combine(into, key, [v * w if w else 0.0, w])
        else:
            _combine(into, key, [v])


def read_metrics_once(per_mb: list[tuple[dict[str, Any], float]]
                      ) -> list[tuple[dict[str, Any], float]]:  # fmt: skip
    """The micro-batches' (metrics, loss weight) with every tensor value (0-dim, on the device;
    also inside a `Mean`) read to a float in one device-to-host transfer, so that an op's
    passes never wait on the host for a metric."""
    leaves = [t for metrics, _ in per_mb for v in metrics.values()
              for t in (v if isinstance(v, Mean) else (v,)) if isinstance(t, torch.Tensor)]  # fmt: skip
    if not leaves:
        return per_mb
    values = iter(torch.stack([t.detach().reshape(()).double() for t in leaves]).tolist())

    def read(v: Any) -> Any:
        return next(values) if isinstance(v, torch.Tensor) else v

    return [({k: Mean(read(v.value), read(v.weight)) if isinstance(v, Mean) else read(v)
              for k, v in metrics.items()}, weight) for metrics, weight in per_mb]  # fmt: skip


def _combine(into: MetricSums, key: str, part: list[float]) -> None:
    if key not in into:
        into[key] = list(part)
        return
    rule, have = merge_rule(key), into[key]
    if rule == "mean":
        have[0] += part[0]
        have[1] += part[1]
    elif rule == "max":
        have[0] = max(have[0], part[0])
    elif rule == "min":
        have[0] = min(have[0], part[0])
    else:
        have[0] += part[0]


def combine_metric_sums(parts: list[MetricSums]) -> dict[str, float]:
    """The metrics of one op from each rank's `accumulate_metrics` sums."""
    total: MetricSums = {}
    for part in parts:
        for key, value in part.items():
            _combine(total, key, value)
    return {key: (v[0] / v[1] if v[1] else 0.0) if merge_rule(key) == "mean" else v[0]
            for key, v in total.items()}  # fmt: skip


def combine_step_metrics(results: list[dict[str, Any]]) -> dict[str, float]:
    """One forward_backward's metrics from each rank's part: each loss metric merges by its
    `merge_rule` over every micro-batch of every rank; counts add."""
    merged = combine_metric_sums([part["metric_sums"] for part in results])

    def total(key: str) -> int:
        return sum(int(part[key]) for part in results)

    return {
        **merged,
        "n_samples": total("n_samples"),
        "n_tokens": total("n_tokens"),
        "n_trained_tokens": total("n_trained_tokens"),
        "padding_efficiency": total("n_tokens") / max(1, total("n_slots")),
        "n_microbatches": total("n_microbatches"),
        "time_forward_backward_s": max(part["time_forward_backward_s"] for part in results),
    }


def merge_metrics(into: dict[str, float], metrics: dict[str, Any], weight: float) -> None:
    """Add `weight` × each numeric metric into `into` (e.g. 1/n for the mean of n updates);
    by `merge_rule`, extremes keep the extreme and counts add unweighted."""
    for key, value in metrics.items():
        if not isinstance(value, int | float):
            continue
        rule = merge_rule(key)
        if rule == "max":
            into[key] = max(into.get(key, float("-inf")), float(value))
        elif rule == "min":
            into[key] = min(into.get(key, float("inf")), float(value))
        elif rule == "sum":
            into[key] = into.get(key, 0.0) + float(value)
        else:
            into[key] = into.get(key, 0.0) + float(value) * weight
