"""A trainer that cleans up after itself: interrupted checkpoint writes, full disks, resumed logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollouts.errors import CheckpointError
from training.backend import checkpoint
from training.backend.checkpoint import (
    begin_checkpoint,
    check_free_space,
    find_latest_checkpoint,
    reclaim_temp_dirs,
    write_checkpoint,
)
from training.backend.model_io import load_model
from training.loops.loggers import JsonlLogger


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def write(tmp_path, step: int, model, tokenizer):
    return write_checkpoint(tmp_path, step, model=model, tokenizer=tokenizer,
                            torch_state={"rng": torch.zeros(3)}, json_state={"step": step},
                            keep_last=2)  # fmt: skip


def test_temp_dirs_of_writers_that_died_are_reclaimed(tmp_path, model, tiny_tokenizer):
    write(tmp_path, 1, model, tiny_tokenizer)
    orphan = tmp_path / f".step_000002.tmp-{dead_pid()}"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"half")
    pointer = tmp_path / f".latest.tmp-{dead_pid()}"
    pointer.write_text("step_000002\n")
    live = tmp_path / ".step_000003.tmp-1"  # pid 1 is alive: another writer, left alone
    live.mkdir()
    assert sorted(reclaim_temp_dirs(tmp_path)) == sorted([orphan, pointer])
    assert not orphan.exists() and not pointer.exists() and live.exists()
    assert find_latest_checkpoint(tmp_path).name == "step_000001"


class FullDiskTokenizer:
    """Fails like a full disk when saved (the failure must not leave a temporary dir)."""

    def save_pretrained(self, out):
        raise OSError(28, "No space left on device")


def test_a_failed_write_removes_its_temp_dir_and_keeps_the_last_checkpoint(
    tmp_path, model, tiny_tokenizer
):
    write(tmp_path, 1, model, tiny_tokenizer)
    with pytest.raises(CheckpointError, match=r"no space left on /.*step_000002: needed .* free"):
        write(tmp_path, 2, model, FullDiskTokenizer())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert find_latest_checkpoint(tmp_path).name == "step_000001"


def test_not_enough_free_space_says_how_much_is_needed(tmp_path):
    check_free_space(tmp_path, 1, what="checkpoint step_000001")
    with pytest.raises(CheckpointError, match=r"GiB needed, .* GiB free"):
        check_free_space(tmp_path, 1 << 60, what="checkpoint step_000001")


@pytest.fixture
def small_disk(tmp_path):
    """Mount a real tmpfs of the size asked for (root only: skipped elsewhere)."""
    mounted = []

    def mount(size_mb: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs",
                               str(where)], capture_output=True, text=True, timeout=10)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], timeout=10, check=False)


def test_the_free_space_margin_scales_with_the_checkpoint(small_disk):
    disk = small_disk(70)  # 70 MiB free: room for a 48 MB checkpoint
    tmp, _ = begin_checkpoint(disk / "checkpoints", 1, 48_000_000)
    assert tmp.is_dir()
    with pytest.raises(CheckpointError, match="not enough free space"):
        begin_checkpoint(disk / "checkpoints", 2, 70 << 20)


def test_a_disk_that_fills_during_the_run_gives_one_error_line_naming_it(
    small_disk, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    from training.recipes.cli import EXIT_ERROR, sft_main

    disk = small_disk(20)  # smaller than the checkpoint: its write runs out of space
    # Stands in for another writer filling the disk between the free-space check and the write.
    monkeypatch.setattr(checkpoint, "check_free_space", lambda *args, **kwargs: None)
    code = sft_main(["--config", str(Path(__file__).parents[1] / "configs" / "sft_tiny.yaml"), "--output-dir", str(disk / "out"),
                     "--max-steps", "1", "train.checkpoint_every=1", f"model.path={tiny_model_dir}",
                     f"data.task_dir={tmp_path / 'data'}", "backend.num_threads=1",
                     "train.greedy_eval_samples=0", "data.arithmetic.n_sft=400",
                     "data.arithmetic.n_eval=50"])  # fmt: skip
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line[:4].isdigit()]  # log lines aside
    assert code == EXIT_ERROR, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: no space left on {disk} "), err
    assert "step_000001: needed " in lines[0] and " free " in lines[0]
    assert not [p for p in (disk / "out" / "checkpoints").iterdir() if p.name.startswith(".")]


async def test_resume_lines_are_logged_as_checkpoint_lines_not_sft(tmp_path, caplog):
    from types import SimpleNamespace

    from training.loops.sft import maybe_resume

    (tmp_path / f".step_000002.tmp-{dead_pid()}").mkdir()
    backend = SimpleNamespace(checkpoint_dir=tmp_path)  # only its directory is read here
    with caplog.at_level("INFO"):
        assert await maybe_resume(backend, None, SimpleNamespace(resume="never")) == 0
    assert [r.name for r in caplog.records] == ["rollouts.checkpoint"]


def test_a_resumed_run_replaces_the_rows_after_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlLogger(path)
    for step in range(1, 6):  # killed after logging step 5, last checkpoint at step 3
        first(step, {"loss": float(step)})
    first.close()
    resumed = JsonlLogger(path)
    for step in (4, 5, 6):
        resumed(step, {"loss": 10.0 * step})
    resumed.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0]
