"""Configuration: frozen pydantic models, YAML files and dotted command-line overrides.

Every recipe in `configs/` maps 1:1 onto these models. Unknown keys and bad values are errors
that name the key (and the file), raised before anything expensive starts. The resolved config
is logged at start and saved with every checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from plumbing.errors import ConfigError
from rollouts.config import Strict
from training.config_hints import locate, trl_hint, unknown_key_hint
from training.logging_config import LoggingConfig as LoggingConfig
from training.logging_config import TensorBoardSettings as TensorBoardSettings
from training.logging_config import WandbSettings as WandbSettings
from training.trl_names import SFT_TABLES

C = TypeVar("C", bound=BaseModel)


class LoraSettings(Strict):
    """LoRA adapters on the policy (peft): only they train; the base model stays frozen.

    ```yaml
    model:
      lora: {rank: 8}            # or on the command line: model.lora.rank=8
    ```
    """

    rank: int = Field(ge=1, description="LoRA rank r")
    alpha: float | None = Field(None, gt=0, description="scale numerator; None: 2 x rank")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names (e.g. [q_proj, v_proj]) or every linear layer"
    )
    name: str = Field(
        "policy",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="adapter name on the engines; pushes load `<name>-v<N>`",
    )
    keep: int = Field(2, ge=1, description="adapter versions left loaded on each engine")
    merged_export: bool = Field(
        False, description="also write a merged full HF model (`merged/`) with each checkpoint"
    )

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and (not value or not all(m.strip() for m in value)):
            raise ValueError("give module names such as [q_proj, v_proj], or 'all-linear'")
        return value

    @model_validator(mode="after")
    def _default_alpha(self) -> LoraSettings:
        if self.alpha is None:  # frozen model: set the derived default once, at validation
            object.__setattr__(self, "alpha", 2.0 * self.rank)
        return self


class ModelConfig(Strict):
    path: str | None = Field(
        None, description="HF model directory or hub id; None builds the tiny local model"
    )
    tiny_dir: str = "runs/tiny_model"
    tiny_seed: int = 0
    tiny_size: Literal["tiny", "small"] = "tiny"
    dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["sdpa", "segments"] = Field(
        "sdpa",
        description="segments: padding-free attention over packed and prompt-shared rows (no 4D "
        "mask, no K/V expansion; FlashAttention varlen / FlexAttention on CUDA): docs/gpus.md",
    )
    enable_thinking: bool | None = Field(
        None,
        description="thinking mode of chat templates that take it (Qwen3): passed to the "
        "template for SFT samples and RL prompts; null: the template's default",
    )
    lora: LoraSettings | None = Field(None, description="LoRA adapters; None: full fine-tuning")


class ArithmeticTaskConfig(Strict):
    min_digits: int = Field(1, ge=1, le=9)
    max_digits: int = Field(2, ge=1, le=9)
    ops: str = Field("+", pattern=r"^[+\-]+$")
    n_sft: int = Field(20000, ge=1)
    n_rl: int = Field(4000, ge=1)
    n_eval: int = Field(500, ge=1)
    seed: int = 0
    teacher_carry_error: float = Field(
        0.0, ge=0, le=1, description="share of SFT sums with a units carry answered without it"
    )


class MultiplyTaskConfig(Strict):
    """The calculator tool-use task (rollouts.tasks.multiply)."""

    min_digits: int = Field(3, ge=1, le=9)
    max_digits: int = Field(4, ge=1, le=9)
    n_sft: int = Field(4000, ge=1)
    n_rl: int = Field(4000, ge=1)
    n_eval: int = Field(200, ge=1)
    seed: int = 0
    tool_specs: bool = Field(False, description="put the calculator's JSON schema in prompts")
    direct_fraction: float = Field(0.0, ge=0, le=1, description="SFT answers without the tool")


class TaskDataSource(Strict):
    """Where a run's records come from: a JSONL file, or (train_path null) a generated task."""

    train_path: str | None = Field(None, description="JSONL; None generates the task's data")
    eval_path: str | None = None
    task: Literal["arithmetic", "multiply"] | None = "arithmetic"
    task_dir: str = "runs/data/arithmetic"
    arithmetic: ArithmeticTaskConfig = ArithmeticTaskConfig()
    multiply: MultiplyTaskConfig = MultiplyTaskConfig()
    shuffle_seed: int = 0

    def write_task_files(self) -> Any:
        """Generate the task's files under `task_dir` (deterministic; safe to repeat).

        Returns:
            An object with `sft_train`, `sft_eval`, `rl_train`, `rl_eval` paths.

        Raises:
            ConfigError: `task` is null (then `train_path` must be given).
        """
        if self.task == "arithmetic":
            from rollouts.tasks.arithmetic import write_arithmetic_datasets

            return write_arithmetic_datasets(self.task_dir, **self.arithmetic.model_dump())
        if self.task == "multiply":
            from rollouts.tasks.multiply import write_multiply_datasets

            return write_multiply_datasets(self.task_dir, **self.multiply.model_dump())
        raise ConfigError("data.train_path is not set and data.task is null: nothing to train on")


DEFAULT_PACK_LENGTH = 256  # tokens per packed row when neither length is set


class DataConfig(TaskDataSource):
    """Where SFT records come from, and how long a sample may be.

    The lengths default to the data: `max_seq_len: null` keeps every record whole (the longest
    one, measured when the data is tokenized, capped by the model's context), and
    `pack_length: null` follows it (at least `DEFAULT_PACK_LENGTH`). Setting `max_seq_len` is
    the one key to change to cut samples; `pack_length` then grows with it.
    """

    max_seq_len: int | None = Field(
        None,
        ge=8,
        description="longest sample kept, in tokens; null: the longest record in the data, "
        "capped by the model's context (max_position_embeddings)",
    )
    overlong: Literal["truncate", "drop"] = "truncate"
    packing: bool = True
    pack_length: int | None = Field(
        None,
        ge=8,
        description=f"tokens per packed row; null: max({DEFAULT_PACK_LENGTH}, max_seq_len)",
    )
    report_path: str | None = Field(None, description="JSONL: every record cut or dropped; "
                                    "null: <output_dir>/data_report.jsonl")  # fmt: skip


class OptimConfig(Strict):
    name: Literal["adamw", "sgd"] = Field(
        "adamw", description="the optimizer (code may pass any: training/backend/optim.py)"
    )
    lr: float = Field(1e-3, gt=0)
    momentum: float = Field(0.0, ge=0, description="SGD's momentum (name: sgd only)")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float | None = Field(1.0, gt=0)
    fused: bool = Field(
        False,
        description="torch's fused AdamW (CPU/CUDA): one kernel for the optimizer step (~3x"
        " faster on CPU; on one H100 under FSDP2 the whole SFT step moved by less than its"
        " run-to-run noise), same update up to rounding; rounding differences can move where a"
        " long SFT run lands",
    )


class FSDPConfig(Strict):
    """Options of the FSDP2 path (used only under torchrun, world size > 1, unless
    `at_world_size_1`)."""

    reshard_after_forward: bool = Field(True, description="free gathered params after forward")
    param_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="mixed precision: dtype of the gathered params in compute"
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="mixed precision: dtype of gradient reduce-scatter"
    )
    accumulate_unsharded: bool = Field(
        True,
        description="keep params gathered and gradients unreduced across an op's micro-batches; "
        "reduce-scatter once, on the last (memory: gathered params + fp32 grads per rank)",
    )
    activation_checkpointing: bool = False
    compile_layers: bool = Field(
        False,
        description="torch.compile each decoder layer (fewer, fused kernels); off until the GPU "
        "check measures it faster (benchmarks/gpu_check.py, docs/gpus.md)",
    )
    cpu_offload: bool = Field(False, description="keep sharded params and grads on CPU")
    command_timeout_s: float = Field(
        1800.0, gt=0, description="how long ranks ≥ 1 wait for rank 0's next operation"
    )
    shutdown_timeout_s: float = Field(
        60.0, gt=0, description="how long a finished rank waits for the others at the end"
    )
    at_world_size_1: bool = Field(
        False,
        description="shard with FSDP2 in a process group of one too (WORLD_SIZE=1 with "
        "MASTER_ADDR/PORT set, or torchrun --nproc_per_node 1): the multi-GPU code path on "
        "one GPU, as benchmarks/gpu_check.py runs it",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "collective_timeout_s" in data:
            raise ValueError(
                "backend.fsdp.collective_timeout_s moved to backend.collective_timeout_s "
                "(the collective watchdog's deadline, default 120 s)"
            )
        return data


class BackendConfig(Strict):
    device: str = "cpu"
    micro_batch_tokens: int | Literal["auto"] = Field("auto", description="token budget per "
        "micro-batch; auto: the most the free memory holds (8192 on CPU): micro_batch_size.py")  # fmt: skip
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    seed: int = 0
    collective_timeout_s: float = Field(
        120.0,
        gt=0,
        description="under torchrun: a rank waiting longer in one collective fails, naming the "
        "op, the step and what every rank was doing (training/distributed/watchdog.py)",
    )
    fsdp: FSDPConfig = FSDPConfig()

    @field_validator("micro_batch_tokens", mode="before")
    @classmethod
    def _auto_or_count(cls, value: Any) -> Any:
        if value == "auto" or (
            isinstance(value, int) and not isinstance(value, bool) and value >= 8
        ):
            return value
        raise ValueError("give `auto` or a token count ≥ 8")


class SFTLoopConfig(Strict):
    """How long SFT trains (`max_steps` or `epochs`, not both: see docs/sft.md), evaluates, saves."""

    batch_size: int = Field(32, ge=1, description="samples per optimizer step")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; null: from epochs")
    epochs: float | None = Field(None, gt=0, description="passes over the records; null: 3")
    max_wall_s: float | None = Field(
        None,
        gt=0,
        description="also stop after the first step ending this many seconds into "
        "this call's training (a time-matched baseline); evaluated and saved like the last step",
    )
    log_every: int = Field(1, ge=1, description="a console line every this many steps")
    eval_every: int | None = Field(None, ge=1, description="null: 10 evals in a run")
    eval_samples: int = Field(256, ge=0, description="held-out samples for eval loss")
    greedy_eval_samples: int = Field(500, ge=0, description="held-out prompts for accuracy")
    checkpoint_every: int = Field(200, ge=1)
    keep_last: int = Field(2, ge=1)
    keep_best: bool = Field(False, description="checkpoints/best: the lowest eval loss's step")
    resume: Literal["auto", "never"] = "auto"

    @model_validator(mode="after")
    def _one_length(self) -> SFTLoopConfig:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError(
                f"train.max_steps={self.max_steps} and train.epochs={self.epochs:g} both set "
                "the run's length: give one and set the other to null (on the command line, "
                "--max-steps or --epochs replaces the other)"
            )
        return self


class SFTRunConfig(Strict):
    trl_tables: ClassVar[tuple[str, ...]] = SFT_TABLES  # TRL names an unknown key is matched to
    output_dir: str = "runs/sft"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    backend: BackendConfig = BackendConfig()
    train: SFTLoopConfig = SFTLoopConfig()
    logging: LoggingConfig = LoggingConfig()


def _parse_value(raw: str) -> Any:
    """Interpret an override value as YAML (numbers, booleans, lists), else keep the string."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with `a.b.c=value` overrides applied.

    Raises:
        ConfigError: an override is not of the form key=value.
    """
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value, e.g. optim.lr=1e-4")
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if node.get(part) is None:  # absent or `null` (e.g. `lora: null`): a new section
                node[part] = {}
            child = node[part]
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return out


def _format_validation_error(err: ValidationError, source: str, cls: type[BaseModel],
                             path: Path | None, overrides: Sequence[str]) -> str:  # fmt: skip
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        where = locate(key, path, overrides) or source
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key {key!r}{unknown_key_hint(key, cls)}")
        else:
            hint = trl_hint(key, cls)
            lines.append(f"{where}: {key}: {e['msg']} (got {e.get('input')!r}){hint}")
    return "invalid config:\n  " + "\n  ".join(lines)


def build_config(cls: type[C], data: dict[str, Any], *, source: str = "<config>",
                 path: Path | None = None, overrides: Sequence[str] = ()) -> C:  # fmt: skip
    """Validate a plain dict into `cls`, turning pydantic errors into ConfigError naming keys.

    `path` and `overrides`, where `data` came from them, let the error say `file:line` or the
    override that set a bad key (training/config_hints.py).
    """
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source, cls, path, overrides)) from None


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] = ()) -> C:
    """Load YAML at `path` (optional), apply dotted overrides, validate into `cls`.

    Raises:
        ConfigError: missing file, invalid YAML, unknown key or bad value (named).
    """
    data: dict[str, Any] = {}
    source = "<defaults>"
    p = None if path is None else Path(path)
    if p is not None:
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ConfigError(f"{p}: invalid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    if overrides:
        data = apply_overrides(data, list(overrides))
        source = f"{source} + overrides"
    return build_config(cls, data, source=source, path=p, overrides=list(overrides))


def config_to_yaml(config: BaseModel) -> str:
    """The resolved config as YAML (what is logged and saved with checkpoints)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
