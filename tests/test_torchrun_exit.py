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
