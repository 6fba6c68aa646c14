"""Loading HF models and tokenizers, with errors that name the path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from plumbing.errors import ModelLoadError
from plumbing.gc_pause import gc_paused
from plumbing.model_paths import resolve_model_dir


def check_model_path(path: str | Path) -> None:
    """Fail early, naming the path and the cause, when `path` names no loadable model here.

    The rule is `plumbing.model_paths.resolve_model_dir` (a model, run, checkpoints or
    checkpoint directory, or a hub id); this is it for callers that only check.

    Raises:
        ModelLoadError: see `resolve_model_dir`.
    """
    resolve_model_dir(path)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a model directory (any form `resolve_model_dir` takes) or hub id (pad
    token defaulted to EOS).

    Raises:
        ModelLoadError: the path does not hold a loadable tokenizer (names the path).
    """
    path = resolve_model_dir(path)
    try:
        with gc_paused():  # transformers' import and the load: ~0.5 CPU s of collector passes
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load a tokenizer from {path!s}: {err}") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str | Path, *, dtype: str = "float32", device: str = "cpu",
               attention: str = "sdpa") -> torch.nn.Module:  # fmt: skip
    """An HF causal LM from a directory (any form `resolve_model_dir` takes) or hub id;
    `attention="segments"` selects the padding-free attention (training/data/segment_attention.py).

    Raises:
        ModelLoadError: the path does not hold a loadable model (names the path).
    """
    path = resolve_model_dir(path)
    try:
        with gc_paused():  # the model's code and modules: plumbing/gc_pause.py
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load model from {path!s}: {err}") from err
    if attention == "segments":
        from training.data.segment_attention import use_segment_attention

        use_segment_attention(model)
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


def generate_greedy(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int
) -> list[list[int]]:
    """Greedy decoding of token-id prompts, left-padded in batches; new ids (eos included)."""
    out: list[list[int]] = []
    for k in range(0, len(prompts), batch_size):
        out += generate_batch(model, tokenizer, prompts[k : k + batch_size], max_new_tokens)
    return out


def generate_batch(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int,
                   *, synced: bool = False) -> list[list[int]]:  # fmt: skip
    """Greedy decoding of one left-padded batch; new ids (eos included).

    `synced`: transformers' `synced_gpus` (under torchrun, with a sharded model): every rank
    keeps making forward passes until every rank's batch is done.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    from training.data.segment_attention import dense_attention

    with torch.no_grad(), eval_mode(model), dense_attention(model):
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad, synced_gpus=synced)  # fmt: skip
    return [row[: row.index(eos) + 1] if eos in row else row for row in gen[:, width:].tolist()]


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every dropout of `model` has probability 0, restored on exit.

    What is set to 0: each `nn.Dropout`-family module (as TRL's `disable_dropout_in_model`;
    peft's `lora_dropout` is one) and each float `attention_dropout` attribute (how transformers'
    attention layers hold theirs). The model stays in its mode otherwise: train mode keeps what
    depends on it, e.g. activation checkpointing, which transformers runs only in train mode.
    """
    saved: list[tuple[Any, str, float]] = []
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            saved.append((module, "p", module.p))
        if isinstance(getattr(module, "attention_dropout", None), float):
            saved.append((module, "attention_dropout", module.attention_dropout))
    for module, name, _ in saved:
        setattr(module, name, 0.0)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
