"""benchmarks/launch_counts.py: the kernel-launch counter runs (at a test's size: 2 layers,
lengths ÷ 4 more than the check's replica) and shows what each change does: accumulation keeps
the loss and grad norm bit-identical with fewer launches, and all changes together launch far
fewer ops than today for the same loss. The 24-layer figures are in docs/gpus.md."""

from __future__ import annotations

import json
import os

from tests import warm_python
from tests.distributed_launch import ROOT


def test_launch_counts_fall_with_each_change_at_the_same_loss(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = warm_python.run([ROOT / "benchmarks" / "launch_counts.py", "--quick", "--layers", "2"],
                           cwd=tmp_path, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| SFT launches" in proc.stdout and "micro-batch tokens × V" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT "))
    r = json.loads(line.removeprefix("BENCH_RESULT "))
    assert list(r) == ["today", "+accumulate", "+segments", "+large micro-batch"]
    for phase in ("sft", "grpo"):
        today, acc, last = (
            r["today"][phase],
            r["+accumulate"][phase],
            r["+large micro-batch"][phase],
        )
        assert today["launches"] > 500
        assert acc["launches"] < today["launches"]
        assert (acc["loss"], acc["grad_norm"]) == (today["loss"], today["grad_norm"])
        assert abs(last["grad_norm"] - today["grad_norm"]) < 1e-2 * today["grad_norm"]
    assert r["+large micro-batch"]["sft"]["launches"] < 0.7 * r["today"]["sft"]["launches"]
    assert r["today"]["sft"]["n_microbatches"] > r["+large micro-batch"]["sft"]["n_microbatches"]
