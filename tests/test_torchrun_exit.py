"""A finished torchrun job exits 0, every time (issue 33).

The property: when a 2-rank RL job (engine, reference model, checkpoint at the last step) ends,
every rank has ended its process groups and joined their gloo threads before its interpreter
finalizes — a gloo thread alive then can abort the rank ("terminate called without an active
exception", training/distributed/teardown.py) — the job exits 0, and the last checkpoint is
complete. `tests/test_distributed.py` checks one such job in every run; this checks 30 in a row
(`pytest -m stress`; ROLLOUTS_EXIT_RUNS changes the count).
"""

from __future__ import annotations

import os

import pytest

from tests.distributed_launch import launch
from tests.torchrun_exit import ROOT, run_once


@pytest.mark.stress
def test_thirty_finished_torchrun_jobs_all_exit_0(tiny_model_dir, tmp_path):
    runs = int(os.environ.get("ROLLOUTS_EXIT_RUNS", "30"))
    failed = {}
    for i in range(runs):
        problems = run_once(ROOT, tiny_model_dir, tmp_path / f"run{i:03d}")
        if problems:
            failed[i] = problems
    assert not failed, f"{len(failed)} of {runs} jobs failed: {failed}"


def test_a_worker_rank_whose_group_outlives_the_job_still_exits_0(tiny_model_dir, tmp_path):
    """Something (here a module global) keeps the default group alive past the job: rank 0
    warns, and rank 1, which owns its whole process, ends it without finalizing the
    interpreter, so the job exits 0 all the same."""
    proc = launch("tests/distributed_teardown.py", str(tiny_model_dir), str(tmp_path),
                  world=2, cwd=tmp_path, timeout=180)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "gloo threads outlive the destroyed process groups" in out, out[-3000:]
    assert "ending the process without finalizing the interpreter" in out, out[-3000:]
    assert "rank 0 returned" in proc.stdout and "rank 1 returned" not in proc.stdout
