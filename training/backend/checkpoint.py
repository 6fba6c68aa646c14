"""Checkpoints on disk: HF layout plus trainer state, written atomically, pruned to the last K.

Layout of one checkpoint directory (`<checkpoint_dir>/step_000010/`):
    config.json, model.safetensors, generation_config.json, tokenizer files   (HF layout: an
        inference server can be started on it, `from_pretrained` loads it)
    dcp/                 optimizer state, sharded by parameter name (torch.distributed.checkpoint):
        written by every rank under torchrun, loadable at any world size. The model's weights
        are stored once, in model.safetensors, and read back from there on resume (rank 0 reads,
        every rank gets its shards); a LoRA checkpoint holds its adapter here too (peft's
        adapter files beside it are what engines load). Checkpoints written before this also
        hold the model in dcp/, and still load.
    trainer_state.pt     scheduler and RNG states, extra tensors (torch.load(weights_only=True));
        checkpoints older than dcp/ hold the optimizer here
    trainer_state.json   step, weight_version, metrics, extra state (DataBuffer, resolved config)
`<checkpoint_dir>/latest` names the newest complete checkpoint; `<checkpoint_dir>/best`, when
SFT's `train.keep_best` is on, is a symlink to the one with the lowest eval loss (kept by pruning).

Guarantees: a checkpoint is written into a temporary sibling directory and renamed into place
only when complete, and `latest` is replaced atomically after that, so a crash at any point
leaves the previous checkpoint and pointer intact. A write that fails removes its temporary
directory; one killed mid-write leaves it behind, and `reclaim_temp_dirs` (called when a loop
starts and before each write) removes those of writers that are gone. Before writing, the free
space is checked against the size of what will be written plus a margin that scales with it
(5 % + 8 MiB: tokenizer files, configs, filesystem overhead). A disk that fills during the write
(another writer, a quota) fails as `CheckpointError("no space left on <mount> ...: needed …,
free …")`: torch reports a full disk as a bare RuntimeError with no errno, so a write that fails
on a disk with (almost) nothing free counts as a full one. Not covered: concurrent writers to
one dir.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from plumbing import model_paths as _paths
from plumbing.errors import CheckpointError
from training.backend.hf_progress import hf_progress_bars_off

LATEST = _paths.LATEST  # plumbing/model_paths.py reads the layout by these names
BEST = "best"  # symlink to the lowest eval loss's checkpoint (mark_best_checkpoint)
STATE_JSON = _paths.STATE_JSON
STATE_PT = "trainer_state.pt"
DCP_DIR = "dcp"  # model + optimizer shards (torch.distributed.checkpoint), any world size


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_step(checkpoint: Path) -> int:
    """The step a checkpoint directory named by `checkpoint_name` was saved at."""
    return int(checkpoint.name.split("_")[-1])


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def write_checkpoint(
    checkpoint_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    torch_state: dict[str, Any],
    json_state: dict[str, Any],
    keep_last: int | None,
) -> Path:
    """Write one single-process checkpoint (HF layout + trainer state) atomically, point
    `latest` at it and prune old ones. The backend composes the same steps itself
    (`begin_checkpoint`, its files, `write_trainer_state`, `finish_checkpoint`) because under
    torchrun every rank writes into the temporary directory.

    Raises:
        CheckpointError: not enough free space for it (says how much is needed), or the write
            failed (its temporary directory is removed; the previous checkpoint stays).
    """
    needed = tensor_bytes(model.state_dict()) + tensor_bytes(torch_state)
    tmp, final = begin_checkpoint(checkpoint_dir, step, needed)
    try:
        export_hf(model, tokenizer, tmp)
        write_trainer_state(tmp, torch_state, json_state)
    except BaseException as err:
        abandon(tmp, final, err, needed)
        raise
    return finish_checkpoint(checkpoint_dir, tmp, final, keep_last)


def begin_checkpoint(checkpoint_dir: Path, step: int, needed_bytes: int) -> tuple[Path, Path]:
    """(temporary dir, final dir) of the checkpoint of `step`, after reclaiming dead writers'
    temporary dirs and checking that `needed_bytes` (+ a margin) fit."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    reclaim_temp_dirs(checkpoint_dir)
    final = checkpoint_dir / checkpoint_name(step)
    tmp = checkpoint_dir / f".{final.name}{TMP_MARK}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    check_free_space(checkpoint_dir, needed_bytes + free_space_margin(needed_bytes),
                     what=f"checkpoint {final.name}")  # fmt: skip
    tmp.mkdir()
    return tmp, final


def write_trainer_state(tmp: Path, torch_state: dict[str, Any], json_state: dict[str, Any]) -> None:
    torch.save(torch_state, tmp / STATE_PT)
    state_json = json.dumps(json_state, indent=1, default=str)
    (tmp / STATE_JSON).write_text(state_json, encoding="utf-8")


def abandon(tmp: Path, final: Path, err: BaseException, needed_bytes: int) -> None:
    """A write failed: remove its temporary dir; raise a full disk or another write error
    (OSError, torch's RuntimeError, DCP's CheckpointException) as a CheckpointError that names
    the path and the cause. Anything else (a bug, a cancellation) propagates unchanged."""
    full = _out_of_space(err) or _nearly_full(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    if full:
        free = shutil.disk_usage(final.parent).free
        raise CheckpointError(
            f"no space left on {_mount_point(final.parent)} while writing {final}: needed "
            f"{_size(needed_bytes + free_space_margin(needed_bytes))}, free {_size(free)} "
            "(after removing the partial checkpoint); free some space or point output_dir at "
            "a larger disk"
        ) from err
    if isinstance(err, OSError | RuntimeError) or _is_dcp_error(err):
        raise CheckpointError(f"writing {final} failed: {_first_cause(err)}") from err


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NEARLY_FULL_BYTES = 1 << 20  # a write that failed with less than this left: the disk is full


def _causes(err: BaseException) -> list[BaseException]:
    """`err`, what it wraps (DCP's per-rank failures, exception groups) and its causes."""
    found: list[BaseException] = []
    todo = [err]
    while todo and len(found) < 50:
        e = todo.pop()
        if e is None or e in found:
            continue
        found.append(e)
        if _is_dcp_error(e):
            todo.extend(wrapped for wrapped, _ in e.failures.values())
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend((e.__cause__, e.__context__))
    return found


def _out_of_space(err: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in _FULL_ERRNOS for e in _causes(err))


def _nearly_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _is_dcp_error(err: BaseException) -> bool:
    # torch.distributed.checkpoint's CheckpointException is a BaseException holding each
    # rank's error; matched by name so that this module does not import torch.distributed
    return type(err).__name__ == "CheckpointException" and hasattr(err, "failures")


def _first_cause(err: BaseException) -> str:
    """The error's one-line message; for DCP's, the first rank's error (its own message is a
    traceback per rank)."""
    leaf = next(iter(err.failures.values()))[0] if _is_dcp_error(err) and err.failures else err
    return f"{type(leaf).__name__}: {str(leaf).splitlines()[0] if str(leaf) else ''}"


def _mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding `path` (what "df" would name)."""
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def finish_checkpoint(checkpoint_dir: Path, tmp: Path, final: Path, keep_last: int | None) -> Path:
    """Rename the complete `tmp` into place, move `latest` to it, prune to `keep_last`."""
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _write_pointer(checkpoint_dir, final.name)
    if keep_last is not None:
        prune_checkpoints(checkpoint_dir, keep_last)
    return final


TMP_MARK = ".tmp-"  # `.<name>.tmp-<pid>`: a checkpoint or pointer being written by process pid


def free_space_margin(needed_bytes: int) -> int:
    """What a checkpoint of `needed_bytes` tensors needs on top: tokenizer files, configs and
    filesystem overhead (5 % + 8 MiB; a fixed 64 MiB refused small checkpoints on small disks)."""
    return needed_bytes // 20 + (8 << 20)


def reclaim_temp_dirs(checkpoint_dir: Path) -> list[Path]:
    """Remove temporary checkpoint directories and pointer files whose writer is gone.

    A writer killed mid-checkpoint (SIGKILL, OOM, power) leaves `.<name>.tmp-<pid>` behind;
    it is never a checkpoint (only complete ones are renamed into place), so it is safe to
    delete once process <pid> no longer runs (or is this process, which has not started
    writing it).

    Returns:
        What was removed.
    """
    removed = []
    for path in checkpoint_dir.glob(f".*{TMP_MARK}*") if checkpoint_dir.is_dir() else ():
        pid = path.name.rsplit(TMP_MARK, 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and _process_alive(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def check_free_space(directory: Path, needed_bytes: int, *, what: str) -> None:
    """Raise CheckpointError, naming both sizes, when `directory`'s disk has less free space."""
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise CheckpointError(
            f"not enough free space to write {what} in {directory}: about "
            f"{_size(needed_bytes)} needed, {_size(free)} free; free some space "
            "or point output_dir at a larger disk"
        )


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested dict/list structure (e.g. an optimizer state)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def export_hf(model: torch.nn.Module, tokenizer: Any, out_dir: Path,
              state_dict: dict[str, torch.Tensor] | None = None) -> Path:  # fmt: skip
    """Save model (safetensors) and tokenizer in HF layout: what engines load.

    `state_dict`: the full weights to write (gathered from FSDP shards), else the model's own.
    A weight tied to another (an output layer tied to the embeddings) is written once, as
    `save_pretrained` writes the model's own: a gathered copy no longer shares its storage.
    """
    from training.backend.state import tied_names

    if state_dict is not None:
        tied = tied_names(model)
        state_dict = {k: v for k, v in state_dict.items() if k not in tied}
    out_dir.mkdir(parents=True, exist_ok=True)
    with hf_progress_bars_off():  # a bar per weight sync drowned the training log
        model.save_pretrained(out_dir, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def _write_pointer(checkpoint_dir: Path, name: str) -> None:
    tmp = checkpoint_dir / f".{LATEST}{TMP_MARK}{os.getpid()}"
    tmp.write_text(name + "\n", encoding="utf-8")
    tmp.replace(checkpoint_dir / LATEST)


def list_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(
        p for p in checkpoint_dir.glob("step_*") if p.is_dir() and (p / STATE_JSON).is_file()
    )


def prune_checkpoints(checkpoint_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (never those `latest` and `best` name)."""
    keep = {find_latest_checkpoint(checkpoint_dir), (checkpoint_dir / BEST).resolve()}
    for old in list_checkpoints(checkpoint_dir)[:-keep_last]:
        if old not in keep and old.resolve() not in keep:
            shutil.rmtree(old, ignore_errors=True)


def mark_best_checkpoint(checkpoint_dir: Path, step: int) -> Path:
    """Point the `best` symlink at step `step`'s checkpoint (atomically); returns the link."""
    tmp = checkpoint_dir / f".{BEST}{TMP_MARK}{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(checkpoint_name(step), target_is_directory=True)
    tmp.replace(checkpoint_dir / BEST)
    return checkpoint_dir / BEST


def find_latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is none yet."""
    checkpoint_dir = Path(checkpoint_dir)
    pointer = checkpoint_dir / LATEST
    if not pointer.is_file():
        return None
    path = checkpoint_dir / pointer.read_text(encoding="utf-8").strip()
    if not (path / STATE_JSON).is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is missing or incomplete")
    return path


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory or a checkpoints directory (then use its `latest`)."""
    p = Path(path)
    if (p / STATE_JSON).is_file():
        return p
    latest = find_latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(f"no checkpoint at {p}: expected {STATE_JSON} or a '{LATEST}' file")
    return latest


def read_checkpoint_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(json_state, torch_state) of a checkpoint directory."""
    try:
        json_state = json.loads((path / STATE_JSON).read_text(encoding="utf-8"))
        torch_state = torch.load(path / STATE_PT, weights_only=True)
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"cannot read trainer state in {path}: {err}") from err
    return json_state, torch_state


HF_INDEX = "model.safetensors.index.json"  # a sharded export names its files here


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF export in `path`: `model.safetensors`, or the files a sharded
    export's `model.safetensors.index.json` names (save_pretrained splits big models).

    Raises:
        CheckpointError: no weights there, or a file cannot be read (names it).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = path / HF_INDEX
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        else:
            files = [path / "model.safetensors"]
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"cannot read {index}: {err}") from err
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: weight files {missing} not found")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"cannot read the model weights in {file}: {err}") from err
    return weights
