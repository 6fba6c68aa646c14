"""FSDP2 under torchrun, for real: two gloo processes on this machine against one process.

The properties: the gradient of a step is the one-process gradient (SFT and the RL
aggregations), a closed backend is freed on every rank, an RL checkpoint written by two ranks
resumes in one, RL driven from rank 0 pushes weights to the engine, and a rank that dies ends
the job quickly, naming it. SFT resumed across world sizes, with the one-process losses, is
tests/test_two_nodes.py's (1 → 2 → 1, the 2 as two torchrun nodes).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.distributed_launch import GRAD_MODES, ROOT, launch
from tests.torchrun_exit import judge, launch_probed, rl_args

MODES = ("sft", "grpo-token-mean", "grpo-seq-mean", "sft-tied", "grpo-token-mean-tied")
# The recipe's 20,000 SFT examples cost each process ~7 s of CPU to write and tokenize (about half
# of a 4-step launch); a few steps at batch 16 read 400 at most.
SMALL_DATA = ("data.arithmetic.n_sft=400", "data.arithmetic.n_eval=50")


@pytest.mark.parametrize("mode", MODES)
def test_two_process_gradient_equals_the_one_process_gradient(distributed_grads, mode):
    grads = distributed_grads
    one = load_file(str(grads / "w1" / mode / "grads.safetensors"))
    two = load_file(str(grads / "w2" / mode / "grads.safetensors"))
    assert one.keys() == two.keys() and len(one) > 10
    for name, g in one.items():
        scale = g.abs().max().clamp_min(1e-12)
        assert ((two[name] - g).abs().max() / scale).item() < 1e-5, name
    m1 = json.loads((grads / "w1" / mode / "metrics.json").read_text())
    m2 = json.loads((grads / "w2" / mode / "metrics.json").read_text())
    assert m2["n_trained_tokens"] == m1["n_trained_tokens"]
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)


def test_a_closed_backend_frees_its_model_on_every_rank_before_the_next_is_built(
    distributed_grads,
):
    """Found on the H100 (benchmarks/RESULTS.md, gpu_check): under torchrun a closed, dropped
    backend stayed registered with the job on every rank, so a second backend's phase peaked
    5.6 GiB higher: the first one's fp32 weights and AdamW state. The gradient job builds one
    backend per mode in turn, closing and dropping each (tests/distributed_grads.py)."""
    n_modes = len(GRAD_MODES)
    for world, ranks in ((1, (0,)), (2, (0, 1))):
        for rank in ranks:
            events = (distributed_grads / f"w{world}" / f"models-rank{rank}.txt").read_text()
            # each model goes before the next is built (the last one may outlive the job's end)
            expected = [e for n in range(n_modes) for e in (f"built {n}", f"freed {n}")]
            assert events.splitlines()[: 2 * n_modes - 1] == expected[:-1], (world, rank, events)


@pytest.mark.slow
def test_torchrun_rl_with_a_reference_exits_0_with_threads_joined_and_resumes_at_one_process(
    tiny_model_dir, tmp_path
):
    """3 steps on 2 ranks, then 2 more at 1 process. The 2-rank job must exit 0 with every
    rank's gloo threads joined before its interpreter finalizes and a complete last checkpoint
    (tests/torchrun_exit.py; `pytest -m stress` repeats it 30 times)."""
    first = launch_probed(ROOT, rl_args(tiny_model_dir, tmp_path), cwd=tmp_path)
    assert judge(first, tmp_path) == [], first.stderr[-3000:]
    assert first.stdout.strip().splitlines()[-1].startswith("RL done")
    args = rl_args(tiny_model_dir, tmp_path, steps=5)
    again = launch("examples/run_rl.py", *args, "--resume", world=1, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert rows[0]["kl"] == 0.0  # the sharded reference starts as an exact copy of the policy
    assert all(r["kl"] > 0 for r in rows[1:])  # ... and stays behind, also after the resume
    exports = sorted((tmp_path / "rl" / "weights").glob("v*"))
    assert exports, "no weight push was exported for the engine"


def _rank_pid(parent: int, rank: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_quickly_and_is_named(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "run_sft.py"), "--config", str(ROOT / "configs" / "sft_tiny.yaml"),
           "--output-dir", str(tmp_path / "out"), "--max-steps", "100000", "train.log_every=1",
           f"model.path={tiny_model_dir}", f"data.task_dir={tmp_path / 'data'}",
           "backend.num_threads=1", "train.greedy_eval_samples=0", *SMALL_DATA]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines = []
    deadline = threading.Timer(240, proc.kill)  # the wait for training to start has a deadline
    deadline.start()
    try:
        for line in proc.stdout:  # wait until training runs ("step 3/100000 ..." off a tty)
            lines.append(line)
            if re.search(r"\bstep 3\b", line):
                break
        deadline.cancel()
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None, "".join(lines[-20:])
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        rest, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        deadline.cancel()
        proc.kill()
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end after rank 1 died"
    assert proc.returncode != 0
    assert "rank      : 1" in rest or "rank 1" in rest, rest[-3000:]
    # rank 0 says it in one line, naming the rank it lost, without a traceback (torch prefixes
    # a rank's traceback with "[rank0]:"; torchrun's own report after it is the launcher's)
    errors = [line for line in rest.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lost rank 1" in errors[0], rest[-3000:]
    assert "[rank0]:" not in rest and "ExceptionGroup" not in rest, rest[-3000:]
