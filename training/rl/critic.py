"""The critic (value model) PPO needs: the policy's architecture with a scalar head per token.

Built as `AutoModelForTokenClassification(num_labels=1)` from the policy's starting checkpoint:
the transformer trunk starts as the policy's (verl and TRL initialise the critic from the actor
or a reward model) and `score` is a new linear head, zero-initialised so every value starts at
0. It runs as a second `PyTorchTrainingBackend` (own optimizer, own worker thread, checkpoints
in HF layout that `from_pretrained` loads) rather than as a value head on the policy: the value
loss's gradient never reaches the policy's weights, the engines keep loading a plain causal LM
and the two update concurrently. The price is a second copy of the trunk in memory.

Alignment: the value at position t is V(s_t), the state before the token that position t
predicts: the positions of the policy's logprobs (`target_ids != -100`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from plumbing.errors import ModelLoadError
from training.backend.pytorch import PyTorchTrainingBackend
from training.config import OptimConfig
from training.data.packing import IGNORE_INDEX
from training.rl.batch import RLBatch, collate_rl
from training.rl.kl import masked_mean

log = logging.getLogger("rollouts.critic")


def load_value_model(path: str | Path, *, dtype: str = "float32", device: str = "cpu"):
    """A token-level value model from a causal LM checkpoint (or a saved critic).

    Raises:
        ModelLoadError: the path does not hold a loadable model (names the path).
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    try:
        config = AutoConfig.from_pretrained(str(path), num_labels=1)
        config.classifier_dropout = 0.0  # values must not be noisy in training mode
        # transformers prints a LOAD REPORT table (as a WARNING) for the keys a causal LM
        # checkpoint lacks or has over a token classifier: the expected case here, said in
        # one line of ours below. A size mismatch still raises. (Filtered, not silenced by
        # level: a raised level makes transformers log a tensor-parallel check instead.)
        with _without_load_report():
            model, info = AutoModelForTokenClassification.from_pretrained(
                str(path), config=config, dtype=getattr(torch, dtype), output_loading_info=True
            )
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load a value model from {path!s}: {err}") from err
    log.info("critic: value model from %s%s", path, _load_note(info))
    if "score.weight" not in _saved_keys(path):  # a new head: start every value at 0
        with torch.no_grad():
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
    return model.to(device)


_HF_LOAD_LOGGER = "transformers.modeling_utils"  # where transformers logs its LOAD REPORT


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


@contextlib.contextmanager
def _without_load_report() -> Iterator[None]:
    """transformers' loading logger without its LOAD REPORT for the block (other lines kept)."""
    logger, drop = logging.getLogger(_HF_LOAD_LOGGER), _DropLoadReport()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _load_note(info: dict[str, Any]) -> str:
    """What transformers' LOAD REPORT would have said, in a few words ('' if nothing)."""
    new = sorted(info.get("missing_keys", ()))
    unused = sorted(info.get("unexpected_keys", ()))
    parts = ([f"new (value head, starts at 0): {', '.join(new)}"] if new else []) + (
        [f"not used (the LM head): {', '.join(unused)}"] if unused else [])  # fmt: skip
    return f"; {'; '.join(parts)}" if parts else ""


def _saved_keys(path: str | Path) -> set[str]:
    file = Path(path) / "model.safetensors"
    if not file.is_file():
        return set()
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return set(f.keys())


def make_critic(model_path: str | Path, tokenizer: Any, *, optim: OptimConfig, max_steps: int,
                checkpoint_dir: str | Path, micro_batch_tokens: int | str = "auto",
                keep_last: int | None = 2, num_threads: int | None = None,
                dtype: str = "float32", device: str = "cpu",
                auto_reserve_params: float = 0.0) -> PyTorchTrainingBackend:  # fmt: skip
    """A backend over a value model initialised from `model_path` (see the module docstring)."""
    pad_id = tokenizer.pad_token_id
    return PyTorchTrainingBackend(
        partial(load_value_model, model_path, dtype=dtype, device=device), tokenizer,
        optim=optim, max_steps=max_steps, checkpoint_dir=checkpoint_dir,
        micro_batch_tokens=micro_batch_tokens, pack_length=None,
        collate_fn=partial(collate_rl, pad_id=pad_id), keep_last=keep_last,
        num_threads=num_threads, auto_reserve_params=auto_reserve_params,
    )  # fmt: skip


def value_loss_fn(value_clip: float | None):
    """PPO's value loss for the critic backend: ½ (V − R)², token-mean over trained tokens.

    With `value_clip` = ε the new value may move at most ε from the value before the update
    (the batch's `old_values_BT`) before the loss stops pulling it, PPO2-style:
    ½ max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²).
    """

    return partial(value_loss, value_clip=value_clip)


def value_loss(logits: torch.Tensor, batch: RLBatch, *, value_clip: float | None
               ) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """`value_loss_fn`'s loss (module-level: torchrun ranks rebuild it by name)."""
    if batch.returns_BT is None:
        raise ValueError("the critic's batch carries no returns (GAE targets)")
    mask_BT = batch.target_ids != IGNORE_INDEX
    values_BT = logits[..., 0].float()
    returns_BT = batch.returns_BT
    loss_BT = (values_BT - returns_BT).square()
    clipped = torch.zeros_like(mask_BT)
    if value_clip is not None and batch.old_values_BT is not None:
        old_BT = batch.old_values_BT
        clipped_values_BT = old_BT + (values_BT - old_BT).clamp(-value_clip, value_clip)
        clipped_loss_BT = (clipped_values_BT - returns_BT).square()
        clipped = clipped_loss_BT > loss_BT
        loss_BT = torch.maximum(loss_BT, clipped_loss_BT)
    value_loss = 0.5 * masked_mean(loss_BT, mask_BT)
    return value_loss, {
        "value_loss": value_loss.item(),
        "value_clip_fraction": masked_mean(clipped.float(), mask_BT).item(),
        "value_mean": masked_mean(values_BT.detach(), mask_BT).item(),
    }
