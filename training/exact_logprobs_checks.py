"""Whether `engines.exact_logprobs` can make an RL run's engine logprobs exactly the trainer's
(training/rl_config.py validates with it; docs/engines.md, "Exact logprobs").

The engine rescores each finished sequence alone with the trainer's scorer
(training/data/exact_scoring.py) on its own copy of the weights; that equals the trainer's
logprob only when both run the same forward: same dtype, device kind, attention kernels, eager,
no adapters, one sequence per forward, and one forward per sample (single-turn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.rl_config import RLRunConfig


def exact_logprobs_conflicts(config: RLRunConfig) -> str | None:
    """Why `engines.exact_logprobs` cannot give exact logprobs with `config`, and the fix; None
    when it can."""
    ec, model = config.engines, config.model
    if ec.urls or ec.router_url:
        return ("applies to the local engines the run launches; with engines.urls / router_url "
                "set, drop engines.exact_logprobs (SGLang has its own deterministic modes)")  # fmt: skip
    if ec.local_dtype != model.dtype:
        return (f"needs the engine's weights in the trainer's dtype: engines.local_dtype is "
                f"{ec.local_dtype}, model.dtype {model.dtype}; set them equal")  # fmt: skip
    if ec.local_device != config.backend.device.split(":")[0]:
        return (f"needs the engine on the trainer's device kind: engines.local_device is "
                f"{ec.local_device}, backend.device {config.backend.device}; set them equal")  # fmt: skip
    fsdp = config.backend.fsdp
    if fsdp.param_dtype != model.dtype:
        return (f"needs the trainer to compute in model.dtype ({model.dtype}) under torchrun too: "
                f"backend.fsdp.param_dtype is {fsdp.param_dtype}; set it to {model.dtype}")  # fmt: skip
    if fsdp.compile_layers:
        return ("needs the trainer's eager kernels (the engine runs eager): set "
                "backend.fsdp.compile_layers: false")  # fmt: skip
    if model.attention != "sdpa":
        return ("needs model.attention: sdpa (the engine scores with sdpa; the segment "
                "attention's kernels differ)")  # fmt: skip
    if model.lora is not None:
        return "does not cover LoRA (the engine's adapter forward is not the trainer's): drop model.lora"
    if config.env.kind != "single_turn":
        return (f"covers single-turn samples only (env.kind is {config.env.kind!r}: the trainer "
                "scores the whole trajectory in one forward, the engine each turn): set "
                "env.kind: single_turn")  # fmt: skip
    if "share_prompts" in config.train.model_fields_set and config.train.share_prompts:
        return ("scores each sample alone; train.share_prompts=true shares prompt rows: "
                "drop train.share_prompts")  # fmt: skip
    return None
