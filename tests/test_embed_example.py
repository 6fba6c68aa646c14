"""examples/embed_in_trio_app.py: a host trio app cancels training and exits cleanly."""

import os
from pathlib import Path

import pytest

from tests import warm_python
from training.backend.checkpoint import find_latest_checkpoint
from training.backend.pytorch import load_model_and_tokenizer

ROOT = Path(__file__).parent.parent


def engine_processes_for(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "engines.local" in cmdline and marker in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_host_app_cancels_training_and_leaves_no_process_and_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "embed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = warm_python.run([ROOT / "examples" / "embed_in_trio_app.py", "--steps", "3",
                            "--output-dir", out], cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training cancelled after 3 steps" in proc.stdout
    heartbeats = int(proc.stdout.split("heartbeats=")[1].split(";")[0])
    assert heartbeats > 3  # the host's own task kept running beside training
    assert engine_processes_for(str(tmp_path)) == []
    latest = find_latest_checkpoint(out / "checkpoints")
    assert latest is not None and int(latest.name.split("_")[1]) >= 3
    model, tok = load_model_and_tokenizer(latest)
    assert model.config.vocab_size == len(tok)
