"""A CPU check of device placement: `DefaultDeviceFactories` records every tensor factory call
(torch.tensor, arange, zeros, ones, full, empty, ...) that the project's training code makes
without an explicit `device=`. On CPU such a tensor works; on a GPU it lands on the CPU and
the first op that meets a CUDA tensor fails (`index is on cpu, different from other tensors on
cuda:0`, the one bug the first GPU run found). `*_like` and `Tensor.new_*` inherit their
device and are not recorded.

Only calls whose nearest project frame is under training/ count (transformers and torch make
their own choices), and host-side batch building (`HOST_SIDE`: collate functions, whose
tensors are copied to the device as a whole batch by `SFTBatch.to`) is exempt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
TRAINING = str(ROOT / "training") + "/"
FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.full,
             torch.empty, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye,
             torch.scalar_tensor, torch.randperm}  # fmt: skip
# functions that build a batch on the host, to be copied to the device by `SFTBatch.to`
HOST_SIDE = frozenset({"prepare_sft_batch", "prepare_prefix_shared_batch", "collate_rl",
                       "_collate", "_collate_sft", "split_microbatches"})  # fmt: skip


def _project_caller() -> tuple[str, int, list[str]] | None:
    """(file, line, function names on the stack) of the innermost frame outside torch and this
    helper, when it is under training/; None otherwise."""
    frame = sys._getframe(2)
    names: list[str] = []
    caller = None
    while frame is not None:
        file = frame.f_code.co_filename
        names.append(frame.f_code.co_name)
        if caller is None and file != __file__ and "/torch/" not in file:
            caller = (file, frame.f_lineno)
        frame = frame.f_back
    if caller is None or not caller[0].startswith(TRAINING):
        return None
    return caller[0], caller[1], names


class DefaultDeviceFactories(TorchFunctionMode):
    """Inside: `self.calls` lists "function at file:line" for each factory call of the
    training code made without `device=` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = _project_caller()
            if where is not None and not HOST_SIDE.intersection(where[2]):
                file, line, _ = where
                self.calls.append(f"torch.{func.__name__} at {file[len(str(ROOT)) + 1 :]}:{line}")
        return func(*args, **kwargs)
