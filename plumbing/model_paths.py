"""One rule for what a model path means, used by every entry point that loads or serves one.

`rollouts sft` (`model.path`), `rollouts rl` (`model.path`, and the engines it launches),
`rollouts generate`, `rollouts eval`, `rollouts serve` and `load_model` / `load_tokenizer` all
pass the path they are given through `resolve_model_dir`, so each of these names the same
concrete HF model directory (config.json, weights, tokenizer):

- a plain HF model directory: itself;
- a run directory (`runs/x`): its `checkpoints/` directory, as below;
- a checkpoints directory (`runs/x/checkpoints`) or its `latest` file: the checkpoint `latest`
  names;
- a checkpoint (`runs/x/checkpoints/step_000010`; `step_10` is accepted for it): its HF export,
  or its `merged/` model when it holds a LoRA adapter;
- anything that is not a local path (`name` or `namespace/name`): a hub id, unchanged.

Why here: a path that is none of these used to reach transformers, whose error for a directory
without a model is about its tokenizer ("You need to have sentencepiece or tiktoken
installed"); this module names the real cause instead ("runs/x/checkpoints has no checkpoint
yet", "no config.json in DIR"). It knows the checkpoint layout by its file names only
(training/backend/checkpoint.py writes it and imports these names), and imports no torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from plumbing.errors import ModelLoadError

LATEST = "latest"  # in a checkpoints directory: the name of the newest complete checkpoint
STATE_JSON = "trainer_state.json"  # in every complete checkpoint
CHECKPOINTS = "checkpoints"  # in a run directory
MERGED_DIR = "merged"  # the merged full model inside a LoRA checkpoint (`merged_export: true`)
ADAPTER_CONFIG = "adapter_config.json"
FORMS = "an HF model directory, a run directory, its checkpoints/ directory or one checkpoint"


def is_local_path(text: str) -> bool:
    """Whether `text` means a directory here rather than a hub id (`name`, `namespace/name`).

    Absolute, `./`, `~`, two or more slashes, a path that exists, or `dir/name` whose `dir`
    exists here (`runs/nope` when `runs/` does): a directory, so that a typo says "no such
    directory" rather than the hub client's "Repo id must be ..." or, offline, half a minute of
    retries and "couldn't connect".
    """
    return (Path(text).is_absolute() or text.startswith((".", "~")) or text.count("/") > 1
            or Path(text).exists() or ("/" in text and Path(text).parent.is_dir()))  # fmt: skip


def resolve_model_dir(path: str | Path, *, what: str = "model.path (--model)") -> str:
    """The concrete HF model directory `path` names (see the module docstring), or `path`
    itself when it is a hub id.

    Args:
        what: the flag or key the path came from, named in errors.

    Raises:
        ModelLoadError: the path is missing or a file, a run or checkpoints directory with no
            checkpoint yet, a LoRA checkpoint without a merged model, or a directory that is
            none of the accepted forms (each message says which, and what to give instead).
    """
    text = str(path)
    if not is_local_path(text):
        return text
    where = Path(text).expanduser()
    if where.is_file() and where.name == LATEST:
        where = where.parent
    elif not where.is_dir():
        alias = _step_alias(where)
        if alias is None:
            found = "is a file, not a model directory" if where.exists() else "no such directory"
            raise ModelLoadError(f"{what} {text}: {found}; give {FORMS}, or a hub id such as "
                                 "Qwen/Qwen2.5-0.5B-Instruct")  # fmt: skip
        where = alias
    if (where / ADAPTER_CONFIG).is_file() or (where / STATE_JSON).is_file():
        return str(checkpoint_model_dir(where))
    if (where / "config.json").is_file():
        return str(where)
    if (where / LATEST).is_file():
        return str(checkpoint_model_dir(_latest(where)))
    if (where / CHECKPOINTS).is_dir():
        runs = where / CHECKPOINTS
        if not (runs / LATEST).is_file():
            raise ModelLoadError(f"{what} {text}: the run has no checkpoint yet ({runs} has no "
                                 f"'{LATEST}' file); train it first, or give {FORMS}")  # fmt: skip
        return str(checkpoint_model_dir(_latest(runs)))
    if where.name == CHECKPOINTS or any(where.glob("step_*")):
        raise ModelLoadError(f"{what} {text} has no checkpoint yet (no '{LATEST}' file); train "
                             f"first, or give {FORMS}")  # fmt: skip
    raise ModelLoadError(f"{what}: no config.json in {text}; expected {FORMS}")


def checkpoint_model_dir(checkpoint: Path) -> Path:
    """The full HF model of one checkpoint: the checkpoint itself, or its `merged/` when it
    holds a LoRA adapter.

    Raises:
        ModelLoadError: a LoRA checkpoint written without `merged_export`, or a checkpoint
            without an HF export (names the fix).
    """
    if (checkpoint / ADAPTER_CONFIG).is_file():
        merged = checkpoint / MERGED_DIR
        if (merged / "config.json").is_file():
            return merged
        raise ModelLoadError(
            f"{checkpoint} holds a LoRA adapter, not a full model: load it with "
            "peft.PeftModel.from_pretrained(base, dir), or train with "
            f"model.lora.merged_export=true to get a full model in {MERGED_DIR}/"
        )
    if not (checkpoint / "config.json").is_file():
        raise ModelLoadError(f"checkpoint {checkpoint}: no config.json (no HF export of the "
                             "model in it); give another checkpoint or the run's checkpoints/")  # fmt: skip
    return checkpoint


def _latest(checkpoints: Path) -> Path:
    """The checkpoint `checkpoints/latest` names (it must be complete)."""
    pointer = checkpoints / LATEST
    found = checkpoints / pointer.read_text(encoding="utf-8").strip()
    if not (found / STATE_JSON).is_file():
        raise ModelLoadError(f"{pointer} names {found.name}, which is missing or incomplete; "
                             "give one of the complete checkpoints beside it")  # fmt: skip
    return found


def _step_alias(where: Path) -> Path | None:
    """`step_10` for the checkpoint the project names `step_000010`, when that one exists."""
    match = re.fullmatch(r"step_(\d+)", where.name)
    if match is None:
        return None
    named = where.with_name(f"step_{int(match.group(1)):06d}")
    return named if named.is_dir() else None
