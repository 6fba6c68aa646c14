"""Reading an HF checkpoint for a weight update; checking tensors against the model before any
copy, so a refused update (from disk or a broadcast) leaves the old weights in place."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class WeightLoadError(Exception):
    """A weight update was refused; `message` is SGLang's wording for the failure."""


def check_tensors(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], *,
                  complete: bool) -> None:  # fmt: skip
    """Raise WeightLoadError unless every tensor names a weight of `state` with its shape and,
    when `complete` (a whole checkpoint, not one bucket of a broadcast), every weight is there."""
    problems = []
    for name, tensor in tensors.items():
        if name not in state:
            problems.append(f"unexpected weight {name!r}")
        elif tuple(tensor.shape) != tuple(state[name].shape):
            problems.append(
                f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model "
                f"{tuple(state[name].shape)}"
            )
    provided = {state[n].data_ptr() for n in tensors if n in state}
    missing = [n for n in state if n not in tensors and state[n].data_ptr() not in provided]
    if missing and complete:
        problems.append(f"missing weights {missing[:5]}")
    if problems:
        raise WeightLoadError(
            f"Failed to update weights: {'; '.join(problems[:5])}.\n"
            "Rolling back to original weights."
        )


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    directory = Path(path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files and directory.is_dir():
        files = sorted(directory.glob("pytorch_model*.bin"))
    if not files:
        reason = "repository not found" if not directory.exists() else "no weight files found"
        raise WeightLoadError(f"Failed to get weights iterator: {path} ({reason}).")
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / n for n in names]
    tensors: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            if f.suffix == ".safetensors":
                tensors.update(load_file(str(f)))
            else:
                tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    except Exception as exc:
        raise WeightLoadError(f"Failed to get weights iterator: {path} ({exc}).") from exc
    return tensors
