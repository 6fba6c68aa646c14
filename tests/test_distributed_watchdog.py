"""The collective watchdog under torchrun (two gloo processes), for real.

The property: when a rank stops answering (SIGSTOP: alive, sockets open, silent), the job
fails after `backend.collective_timeout_s` rather than gloo's 600 s (15 s here: long
enough that a loaded machine running the suite in parallel never trips it before SIGSTOP), and rank 0 prints one
`error:` line naming the op, the step and what every rank was doing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.distributed_launch import ROOT, kill_tree
from tests.test_distributed import SMALL_DATA, _rank_pid


@pytest.mark.slow
def test_a_rank_that_stops_answering_fails_the_job_naming_the_op_and_every_rank(
    tiny_model_dir, tmp_path
):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "run_sft.py"), "--config", str(ROOT / "configs" / "sft_tiny.yaml"),
           "--output-dir", str(tmp_path / "out"), "--max-steps", "100000", "train.log_every=1",
           f"model.path={tiny_model_dir}", f"data.task_dir={tmp_path / 'data'}",
           "backend.num_threads=1", "train.greedy_eval_samples=0",
           "backend.collective_timeout_s=15", *SMALL_DATA]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    deadline = threading.Timer(300, kill_tree, [proc.pid])  # every wait below has a deadline
    deadline.start()
    victim = None
    try:
        for line in proc.stdout:  # wait until training runs, then stop rank 1
            lines.append(line)
            if victim is None and re.search(r"\bstep 3\b", line):
                victim = _rank_pid(proc.pid, 1)
                assert victim is not None, "".join(lines[-20:])
                os.kill(victim, signal.SIGSTOP)
            if line.startswith("error:"):
                break
        kill_tree(proc.pid)  # rank 1 is stopped: it would wait for torchrun's SIGKILL
        proc.wait(timeout=60)
    finally:
        deadline.cancel()
        kill_tree(proc.pid)
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1, "".join(lines[-30:])
    message = errors[0]
    assert "waited more than 15 s (backend.collective_timeout_s)" in message, message
    assert re.search(r"in a collective of \w+ at step \d+", message), message
    assert "rank 0: " in message and "rank 1: " in message, message
    Path(tmp_path / "watchdog_message.txt").write_text(message)
    print(message)


def test_the_old_fsdp_collective_timeout_key_names_its_new_place():
    import pytest
    from pydantic import ValidationError

    from training.config import BackendConfig

    assert BackendConfig().collective_timeout_s == 120.0
    with pytest.raises(ValidationError, match="moved to backend.collective_timeout_s"):
        BackendConfig.model_validate({"fsdp": {"collective_timeout_s": 600}})
