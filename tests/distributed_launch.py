"""Launching scripts under plain python (world 1) or torchrun (world 2), for the FSDP2 tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
# Every mode `tests/distributed_grads.py` runs; one launch per world size computes them all, and
# the full-model and LoRA tests read their own modes from the same runs.
GRAD_MODES = ("sft", "grpo-token-mean", "grpo-seq-mean", "sft-lora", "grpo-token-mean-lora")


def launch(script: str, *args: str, world: int, cwd: Path, timeout: float = 300):
    """Run `script` under plain python (world 1) or torchrun (world 2), one thread per rank."""
    prefix = [sys.executable]
    if world > 1:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*prefix, str(ROOT / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def gradient_runs(model_dir: Path, out: Path) -> Path:
    """`distributed_grads.py` for every GRAD_MODES mode at world 1 and 2: out/w{1,2}/MODE/."""
    for world in (1, 2):
        proc = launch("tests/distributed_grads.py", str(model_dir), str(out / f"w{world}"),
                      ",".join(GRAD_MODES), world=world, cwd=out)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out
