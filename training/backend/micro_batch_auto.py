"""`micro_batch_tokens="auto"` for a built model: read the model and the device, estimate
(training/backend/micro_batch_size.py), choose, and agree across ranks.

- On CUDA: the free memory is `torch.cuda.mem_get_info()` plus what torch's caching allocator
  holds unused, read after the model is built (so its parameters are already in use).
- On CPU: 8,192 tokens (`CPU_TOKENS`), the fixed budget every CPU test and figure was made with.
- Under torchrun every rank chooses from its own device and all take the smallest choice (one
  all-reduce of every rank's choice, `state.agree_counts`, issued while the backend is built,
  on every rank alike), so they split alike.
- `ROLLOUTS_FREE_MEMORY_BYTES` (bytes), when set, stands in for the device's free memory, on
  CPU too: what `auto` would choose with that much memory (tests give ranks different figures).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from training.backend import micro_batch_size as mbs

log = logging.getLogger("rollouts.backend")

FREE_MEMORY_ENV = "ROLLOUTS_FREE_MEMORY_BYTES"
UNPACKED_ROW_TOKENS = 8192  # the mask width `auto` assumes for unpacked rows under sdpa


def free_device_bytes(device: torch.device) -> float | None:
    """Free memory on `device` (the env override first); None on a CPU without override."""
    given = os.environ.get(FREE_MEMORY_ENV)
    if given:
        return float(given)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _local_numel(p: torch.Tensor) -> int:
    to_local = getattr(p, "to_local", None)  # an FSDP2 shard (DTensor)
    return (to_local() if to_local is not None else p).numel()


def _attention(model: Any) -> mbs.Attention:
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl == "eager":
        return "eager"
    return "masked" if impl == "sdpa" else "varlen"  # segments, flash_attention_*, flex


def _head_width(model: Any) -> int:
    """The output layer's width (the vocabulary; 1 for a value head): the last Linear's."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return linears[-1].out_features if linears else model.config.vocab_size


def estimate(model: Any, *, dist: Any, pack_length: int | None, chunk_tokens: int,
             optimizer_states: int) -> tuple[float, float, float]:  # fmt: skip
    """(activation bytes per slot, fixed bytes still to allocate, this rank's parameter bytes)
    for `model` as built, sharded or not, on this rank."""
    from training.data.logprob_head import output_layer

    params = list(model.parameters())
    fsdp = dist.fsdp if dist is not None else None
    if fsdp is not None and fsdp.param_dtype != "float32":
        compute = getattr(torch, fsdp.param_dtype).itemsize
    else:
        compute = next((p.dtype.itemsize for p in params if p.is_floating_point()), 4)
    trains = any(p.requires_grad for p in params)
    setup = mbs.Setup(
        compute_bytes=compute, attention=_attention(model),
        row_tokens=pack_length or UNPACKED_ROW_TOKENS,
        checkpointing=bool(getattr(model, "is_gradient_checkpointing", False)
                           or (fsdp is not None and fsdp.activation_checkpointing)),
        fused_head=output_layer(model) is not None, chunk_tokens=chunk_tokens, trains=trains,
    )  # fmt: skip
    shape = mbs.ModelShape.of_config(model.config, vocab=_head_width(model))
    gathered = gathered_grads = 0
    if fsdp is not None:
        from training.distributed.context import decoder_layers

        total = sum(p.numel() for p in params)  # a DTensor's numel is the whole tensor's
        trainable = sum(p.numel() for p in params if p.requires_grad)
        layer = max(sum(p.numel() for p in m.parameters()) for m in decoder_layers(model))
        n_layers = len(decoder_layers(model))
        share = 1.0  # accumulate_unsharded: every parameter gathered through the op
        if not fsdp.accumulate_unsharded:  # the root unit and two layers (one prefetched)
            share = min(1.0, (total - n_layers * layer + 2 * layer) / max(total, 1))
        gathered, gathered_grads = int(share * total), int(share * trainable)
    state = mbs.TrainingState(
        params=sum(_local_numel(p) for p in params),
        trainable=sum(_local_numel(p) for p in params if p.requires_grad),
        param_bytes=params[0].dtype.itemsize if params else 4,
        optimizer_states=optimizer_states if trains else 0,
        gathered_params=gathered, gathered_grads=gathered_grads, compute_bytes=compute,
    )  # fmt: skip
    fixed = mbs.pending_bytes(state) + mbs.head_chunk_bytes(shape, setup)
    per_token = mbs.activation_bytes_per_token(shape, setup)
    return per_token, float(fixed), float(mbs.state_bytes(state)["params"])


def resolve(setting: int | str, model: Any, *, device: torch.device, dist: Any,
            pack_length: int | None, chunk_tokens: int, optimizer_states: int = 2,
            reserve_params: float = 0.0) -> int:  # fmt: skip
    """`setting` when it is a number; for "auto" the largest micro-batch this rank's free
    memory holds (the smallest over ranks under torchrun), less `reserve_params` times this
    rank's parameter bytes (models built on the device later: an RL run's reference, critic)."""
    if setting != "auto":
        if isinstance(setting, str) or int(setting) < 1:
            raise ValueError(f"micro_batch_tokens={setting!r}: give 'auto' or a token count ≥ 1")
        return int(setting)
    free = free_device_bytes(device)
    per_token = fixed = 0.0
    config = getattr(model, "config", None)
    if free is not None and not hasattr(config, "num_attention_heads"):
        log.warning("backend.micro_batch_tokens=auto: %s has no HF decoder config to estimate "
                    "from; using %d tokens", type(model).__name__, mbs.CPU_TOKENS)  # fmt: skip
        free = None
    if free is None:
        chosen = mbs.CPU_TOKENS
    else:
        per_token, fixed, param_bytes = estimate(
            model, dist=dist, pack_length=pack_length, chunk_tokens=chunk_tokens,
            optimizer_states=optimizer_states)  # fmt: skip
        fixed += reserve_params * param_bytes
        chosen = mbs.choose_micro_batch_tokens(free, per_token=per_token, fixed_bytes=fixed,
                                               multiple_of=pack_length or mbs.UNPACKED_GRANULE)  # fmt: skip
    local = chosen
    if dist is not None:  # every rank's choice in the backend's one agreeing collective
        from training.backend.state import agree_counts

        chosen = min(agree_counts(chosen, 0.0, dist)[0])
    ranks = f", the least over {dist.world} ranks (this rank's: {local:,})" if dist else ""
    if free is None:
        log.info("backend.micro_batch_tokens=auto: %s tokens (on %s: the fixed CPU budget)%s",
                 f"{chosen:,}", device.type, ranks)  # fmt: skip
    else:
        log.info("backend.micro_batch_tokens=auto: %s tokens (free %.1f GiB, %.0f KiB of "
                 "activations per token, %.1f GiB fixed, %d %% margin)%s", f"{chosen:,}",
                 free / 2**30, per_token / 1024, fixed / 2**30, round(100 * mbs.MARGIN), ranks)  # fmt: skip
        if fixed + chosen * per_token > (1 - mbs.MARGIN) * free:
            log.warning("backend.micro_batch_tokens=auto: even %s tokens may not fit in %.1f "
                        "GiB free; set a smaller int if the step runs out of memory",
                        f"{chosen:,}", free / 2**30)  # fmt: skip
    return chosen


def resolve_for(backend: Any, model: Any, setting: int | str, optimizer_factory: Any,
                reserve_params: float) -> int:  # fmt: skip
    """`resolve` for a `PyTorchTrainingBackend` being built (its settings, its new model)."""
    from training.backend.optim import moments_per_param

    dist = backend._dist  # its device, not the params': with cpu_offload they sit on the CPU
    device = dist.device if dist is not None else next(model.parameters()).device
    return resolve(setting, model, device=device, dist=dist,
                   pack_length=backend.pack_length, chunk_tokens=backend.logprob_chunk_tokens,
                   optimizer_states=moments_per_param(backend.optim_config, optimizer_factory),
                   reserve_params=reserve_params)  # fmt: skip
