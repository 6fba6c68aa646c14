"""The trainer process's GPU memory, as step metrics (nothing on CPU).

Why: a colocated run (training/loops/colocate.py) shares one GPU between the trainer and the
engines, and what each phase holds decides whether it fits (issue 47: peak GPU memory per
phase). The trainer's backends (policy, reference, critic) run on threads of this process at
world size 1, so its caching allocator's figures are theirs; under torchrun `TrainerMemory`'s
are rank 0's only (`memory_train_*`: the ranks hold equal shards, so rank 0's stand for each).

- `TrainerMemory(device).start()` before a phase, `.metrics(prefix)` after it: the most
  allocated on the trainer's `device` during the phase (`{prefix}_peak_gib`) and what is
  allocated and reserved there at its end (nothing unless `device` is a CUDA device).
- `gpu_used_gib()`: the used memory of this thread's current GPU (GPU 0 unless set: where
  launched engines run) as the driver sees it, every process on it (the engines too); None
  when this process has not used CUDA.
- `give_back()`: the trainer's cached, unused blocks returned to the device, so that an engine
  resuming on the same GPU can take them (the caching allocator keeps freed activations
  otherwise: a colocated engine would find the trainer's training peak still reserved). It
  returns what it did: this process's `rank` (0 without torchrun) and, on CUDA, the
  `reserved_gib` left. Under torchrun each rank's allocator holds its own activations, so a
  colocated run has every rank run it (`backend.on_every_rank(give_back)`: colocate.py).
"""

from __future__ import annotations

from typing import Any

GIB = 2**30


def _cuda() -> Any:
    """torch.cuda when this process has used CUDA (never initialises it), else None."""
    import torch

    return torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def gpu_used_gib() -> float | None:
    cuda = _cuda()
    if cuda is None:
        return None
    free, total = cuda.mem_get_info()
    return round((total - free) / GIB, 4)


def give_back() -> dict[str, float]:
    """Return this process's unused cached GPU blocks to the device (only a garbage collection
    without CUDA); what it did (module docstring)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    report = {"rank": dist.get_rank() if dist.is_available() and dist.is_initialized() else 0}
    cuda = _cuda()
    if cuda is not None:
        cuda.empty_cache()
        report["reserved_gib"] = round(cuda.memory_reserved() / GIB, 4)
    return report


class TrainerMemory:
    """The trainer's peak and held GPU memory over one phase (module docstring)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)

    def _cuda(self) -> Any:
        return _cuda() if self.device.type == "cuda" else None

    def start(self) -> None:
        cuda = self._cuda()
        if cuda is not None:
            cuda.reset_peak_memory_stats(self.device)

    def metrics(self, prefix: str) -> dict[str, float]:
        cuda = self._cuda()
        if cuda is None:
            return {}
        return {
            f"{prefix}_peak_gib": round(cuda.max_memory_allocated(self.device) / GIB, 4),
            f"{prefix}_allocated_gib": round(cuda.memory_allocated(self.device) / GIB, 4),
            f"{prefix}_reserved_gib": round(cuda.memory_reserved(self.device) / GIB, 4),
        }
