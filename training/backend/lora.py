"""LoRA on the trained model (peft): wrapping, adapter export, merged export, base-model passes.

With `model.lora` set, the backend wraps the model it builds with `peft.get_peft_model`
before sharding it: the base weights are frozen, only the adapter's `lora_A` / `lora_B`
matrices have gradients, so only they reach the optimizer. What this module guarantees:

- The adapter directory is exactly what `PeftModel.save_pretrained` writes
  (`adapter_model.safetensors`, `adapter_config.json`), so `PeftModel.from_pretrained(base,
  dir)`, SGLang's `/load_lora_adapter` and the local engine load it unchanged. Under torchrun
  the adapter is gathered to rank 0 (it is small), which writes it.
- A merged export (`merge_and_unload`) is made on a copy, never on the training model.
- `base_model_pass(model)` runs the model with its adapters off: the frozen base, i.e. the
  reference policy, without a second copy in memory (LoRA's B starts at 0, so at step 0 the
  policy equals its reference exactly).

Not covered: adapters on embeddings (peft's `all-linear` leaves the output layer and the
embeddings alone), several adapters at once on the trainer, QLoRA.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plumbing.model_paths import MERGED_DIR as MERGED_DIR  # the merged model in a checkpoint
from plumbing.model_paths import checkpoint_model_dir
from training.backend.hf_progress import hf_progress_bars_off

if TYPE_CHECKING:
    from training.config import LoraSettings

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def peft_config(settings: LoraSettings) -> Any:
    """The `peft.LoraConfig` of `model.lora`."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
    )


def wrap_with_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """`model` with fresh LoRA adapters (B = 0: the same function as `model`); base frozen.

    The adapter config records the base model's directory as an absolute path when it is a
    local one, so the saved adapter names the base an engine must have been started on and
    `peft.AutoPeftModelForCausalLM.from_pretrained(adapter_dir)` finds it from any working
    directory. (peft's `get_peft_model` overwrites the config's `base_model_name_or_path` with
    the model's `name_or_path`, the path as it was given, often relative: it is set after.)
    """
    from peft import get_peft_model

    wrapped = get_peft_model(model, peft_config(settings))
    source = getattr(getattr(model, "config", None), "_name_or_path", None)
    if source and Path(source).is_dir():
        for config in wrapped.peft_config.values():
            config.base_model_name_or_path = str(Path(source).resolve())
    return wrapped


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextlib.contextmanager
def base_model_pass(model: torch.nn.Module) -> Iterator[None]:
    """Inside: `model` runs without its adapters (the frozen base); a no-op for a plain model."""
    if not is_lora(model):
        yield
        return
    with model.disable_adapter():
        yield


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights, whole, on CPU, keyed as the model names them: on rank 0 under
    torchrun (a collective: every rank calls it; the others get {}), a copy at world size 1."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {n: p.detach().clone().cpu() for n, p in model.named_parameters() if p.requires_grad}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=options)


def save_adapter(model: torch.nn.Module, out: Path, state: dict[str, torch.Tensor]) -> Path:
    """Write the adapter (`state`, from `adapter_state`) in peft's layout into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    with hf_progress_bars_off():  # one per weight sync: see training/backend/hf_progress.py
        model.save_pretrained(str(out), state_dict=state)
    missing = [name for name in ADAPTER_FILES if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"peft wrote no {missing} in {out}")
    return out


def save_merged(model: torch.nn.Module, out: Path, full_state: dict[str, torch.Tensor],
                tokenizer: Any, rebuild: Any = None) -> Path:  # fmt: skip
    """A full HF model with the adapter merged in (`merge_and_unload`), written to `out`.

    The merge runs on a copy: a deep copy of `model` at world size 1, else `rebuild()` (an
    unsharded model of the same architecture, adapters included) loaded with `full_state`.
    """
    if rebuild is None:
        twin = copy.deepcopy(model)
    else:
        with torch.random.fork_rng():  # fresh adapters draw random numbers: keep the run's
            twin = rebuild()
        twin.load_state_dict(full_state)
    merged = twin.merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    with hf_progress_bars_off():
        merged.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def loadable_model_dir(checkpoint: Path) -> Path:
    """The full HF model of a checkpoint: the checkpoint itself, or its `merged/` when it
    holds a LoRA adapter (`plumbing.model_paths.checkpoint_model_dir`).

    Raises:
        ModelLoadError: a LoRA checkpoint written without `merged_export` (names the fix).
    """
    return checkpoint_model_dir(checkpoint)
