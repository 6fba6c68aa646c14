"""LoRA adapters inside the local engine's model: peft, one wrapper, many adapters, mixed batches.

Contract:
- The base model is wrapped once in a peft `PeftModelForCausalLM` when the first adapter is
  loaded; every adapter is added with `load_adapter` and removed with `delete_adapter` (a
  failed load is deleted again, so it leaves nothing behind). Adapters are loaded for
  inference (`is_trainable=False`, eval mode).
- `forward(names, **model_kwargs)`: row i runs with adapter `names[i]` (None: the base model),
  through peft's `adapter_names=` (LoRA layers apply each adapter to its own rows), so base
  and adapter requests share one batch, in prefill and in decode with the runner's KV cache.
  With peft's layers in the model, base rows must say "__base__": a plain call would apply
  the active adapter to every row.
- Validation before anything is loaded, with SGLang 0.5.23's messages
  (`srt/lora/lora_manager.py::validate_new_adapter`, `srt/lora/mem_pool.py::can_support`):
  rank above `--max-lora-rank`, target modules outside `--lora-target-modules` (after SGLang's
  normalisation: q/k/v → qkv_proj, gate/up → gate_up_proj; "all" accepts any), DoRA, added
  tokens. An unreadable directory gives the `FileNotFoundError` text, which names the path.
- `base_state()`: the base model's own tensors under their checkpoint names (peft's
  `.base_layer` removed, adapter tensors left out), so `/update_weights_from_disk` replaces the
  base weights and the loaded adapters stay, applied on top of the new base, as in SGLang
  (its weight update reloads only the base model; adapters live in a separate pool).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from .lora_registry import LoraLoadError

BASE = "__base__"  # peft's name for "no adapter" in `adapter_names`
_NORMALIZED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def normalized_targets(modules: str | Iterable[str]) -> set[str]:
    """SGLang's `get_normalized_target_modules`: suffixes, fused names, {"all"} for shorthands."""
    if isinstance(modules, str):
        if modules not in ("all", "all-linear"):
            raise LoraLoadError(
                "Only 'all' or 'all-linear' can be used as the string for target module"
            )
        return {"all"}
    names = {m.split(".")[-1] for m in modules}
    return {"all"} if "all" in names else {_NORMALIZED.get(n, n) for n in names}


def read_adapter_config(path: str) -> dict[str, Any]:
    """`adapter_config.json` of a peft adapter directory (relative paths: this process's cwd)."""
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoraLoadError(str(exc)) from exc
    for key in ("r", "target_modules"):
        if key not in config:
            raise LoraLoadError(f"{path}/adapter_config.json has no {key!r}")
    return config


class LoraAdapters:
    def __init__(
        self, model: torch.nn.Module, *, max_lora_rank: int, target_modules: Iterable[str]
    ) -> None:
        self.base = model  # peft injects its layers into this very object
        self.peft: Any = None  # PeftModel, once an adapter was loaded
        self.max_lora_rank = max_lora_rank
        self.target_modules = normalized_targets(list(target_modules))
        self.names: dict[str, str] = {}  # loaded adapter -> path
        self._active: str | None = None  # the adapter peft's layers apply without adapter_names

    def check(self, name: str, config: dict[str, Any], path: str) -> None:
        added = os.path.join(path, "added_tokens.json")
        if os.path.exists(added):
            vocab = int(self.base.config.vocab_size)
            with open(added) as f:
                if any(int(i) >= vocab for i in json.load(f).values()):
                    raise LoraLoadError(
                        f"Failed to load {name} because LoRA serving currently doesn't support "
                        "adapters that add tokens to the vocabulary"
                    )
        if config.get("use_dora"):
            raise LoraLoadError(
                f"Failed to load {name} because LoRA serving currently doesn't support DoRA "
                "adapters"
            )
        targets = normalized_targets(config["target_modules"])
        fits = "all" in targets or "all" in self.target_modules or targets <= self.target_modules
        if int(config["r"]) > self.max_lora_rank or not fits:
            raise LoraLoadError(
                f"LoRA adapter {name} with rank {config['r']} is incompatible with the current "
                "LoRA memory pool configuration. Please ensure that the LoRA adapter's rank is "
                "within the configured `--max-lora-rank` and that the target modules are "
                "included in `--lora-target-modules`."
            )

    @torch.inference_mode(False)
    def load(self, name: str, path: str) -> None:
        from peft import PeftConfig, PeftModelForCausalLM

        self.check(name, read_adapter_config(path), path)
        try:
            if self.peft is None:  # `PeftModel.from_pretrained` in two steps, so that a failed
                config = PeftConfig.from_pretrained(path)  # weight load can be undone below
                config.inference_mode = True
                self.peft = PeftModelForCausalLM(self.base, config, adapter_name=name)
            self.peft.load_adapter(path, adapter_name=name, is_trainable=False)
        except Exception as exc:  # bad weights, shapes: the adapter is not kept
            if self.peft is not None and name in self.peft.peft_config:
                self.peft.delete_adapter(name)
            raise LoraLoadError(f"Failed to load LoRA adapter {name} from {path}: {exc}") from exc
        self.names[name] = path
        self._settle()

    def delete(self, name: str) -> None:
        with warnings.catch_warnings():  # "X was active which is now deleted": _settle picks one
            warnings.simplefilter("ignore", UserWarning)
            self.peft.delete_adapter(name)
        del self.names[name]
        self._settle()

    def _settle(self) -> None:
        """After a load or delete: one adapter active in every layer (peft's forward reads its
        config; peft's own record can name a deleted one), nothing trainable, eval mode."""
        self._active = None
        if self.names:
            self._activate(next(iter(self.names)))
        self.peft.requires_grad_(False)
        self.peft.eval()

    def _activate(self, name: str) -> None:
        if self._active != name:
            self.peft.set_adapter(name, inference_mode=True)
            self._active = name

    def forward(self, names: list[str | None], **kwargs: Any) -> Any:
        """Rows go through peft's `adapter_names`, except a batch that is all one adapter:
        that adapter is made active and the plain path runs, without the per-adapter split
        (tiny model, 32 requests: ~1.25x the tokens/s)."""
        if self.peft is None or not self.names:  # no adapter holds weights
            return self.base(**kwargs)
        distinct = set(names)
        if len(distinct) == 1 and None not in distinct:
            (name,) = distinct
            self._activate(name)
            return self.base(**kwargs)
        return self.peft(**kwargs, adapter_names=[n or BASE for n in names])

    def base_state(self) -> dict[str, torch.Tensor]:
        state = self.base.state_dict()
        return {
            name.replace(".base_layer.", "."): tensor
            for name, tensor in state.items()
            if ".lora_" not in name
        }
