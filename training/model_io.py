"""Loading HF models and tokenizers, with errors that name the path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rollouts.errors import ModelLoadError


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a model directory or hub id (pad token defaulted to EOS).

    Raises:
        ModelLoadError: the path does not hold a loadable tokenizer (names the path).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load a tokenizer from {path!s}: {err}") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str | Path, *, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """An HF causal LM from a directory or hub id.

    Raises:
        ModelLoadError: the path does not hold a loadable model (names the path).
    """
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load model from {path!s}: {err}") from err
    return model.to(device)


def load_model_and_tokenizer(path: str | Path, *, dtype: str = "float32", device: str = "cpu"):
    """Both of the above (for code that runs the model on the calling thread)."""
    tokenizer = load_tokenizer(path)
    return load_model(path, dtype=dtype, device=device), tokenizer


class eval_mode:
    """Context manager: model.eval() inside, restores the previous mode on exit."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.was_training = model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)
