"""The fault matrix of issue 49 (benchmarks/fault_matrix.py) and the dump audit it counts with.

`make test` checks the audit on a hand-made dump (it must find exactly the lost, twice-trained and
stale samples put in it). `make stress` runs cells of the matrix for real: RL through the CLI on
two supervised local engines behind fault proxies, async with disk weights and sync with
distributed weights, under a 10 % fault mix and under an engine SIGKILL, and sync with two rollout
worker processes (issue 47) under an engine SIGKILL and a worker SIGKILL; each must finish with
no sample lost, trained twice or stale, and every engine on the trainer's weight version.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollouts.types import RolloutBatch, Sample
from training.rl.dump_audit import audit_rollout_dump
from training.rl.rollout_dump import RolloutDumpWriter

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [(1, 2, i) for i in range(8)]  # the data's prompts, in the order the run took them


def sample(prompt: int, version: int, response: tuple[int, ...] = (7, 8)) -> Sample:
    return Sample(prompt_ids=PROMPTS[prompt], response_ids=response, loss_mask=(1,) * len(response),
                  rollout_logprobs=(-0.5,) * len(response), weight_version=version)  # fmt: skip


def write_dump(path: Path, lines: list[tuple[int, list[Sample], dict]]) -> None:
    writer = RolloutDumpWriter(path)
    for step, samples, metrics in lines:
        writer(step, RolloutBatch(groups=tuple((s,) for s in samples), step_id=step, epoch_id=0,
                                  metrics=metrics))  # fmt: skip
    writer.close()


def test_dump_audit_counts_exactly_the_lost_twice_trained_and_stale_samples(tmp_path):
    dump = tmp_path / "rollouts.jsonl"
    twice = sample(0, 0, response=(9, 9))
    write_dump(dump, [
        (1, [twice, sample(1, 0)], {}),
        (2, [sample(3, 1), twice], {}),  # prompt 2 is never trained: lost; `twice` again
        (3, [sample(4, 0)], {}),  # version 0 at step 3, more than max lag 1 behind 2: stale
    ])  # fmt: skip
    audit = audit_rollout_dump(dump, max_lag=1, drawn=PROMPTS, held=[])
    assert (audit.lost, audit.twice, audit.stale, audit.steps) == (1, 1, 1, 3)
    # prompt 5 was taken after the last trained one: in flight at the end, not lost
    assert audit.trained == 5


def test_dump_audit_accounts_failed_held_and_resumed_steps_as_not_lost(tmp_path):
    dump = tmp_path / "rollouts.jsonl"
    write_dump(dump, [
        (1, [sample(0, 0), sample(1, 0)], {}),
        (2, [sample(3, 1)], {}),  # redone after a resume: this line's update was discarded
        (2, [sample(2, 1), sample(3, 1)], {}),
        (3, [sample(6, 2)], {"groups_failed": 1.0}),  # prompt 4's group failed, 5 is held
    ])  # fmt: skip
    audit = audit_rollout_dump(dump, max_lag=0, drawn=PROMPTS, held=[PROMPTS[5]])
    assert (audit.lost, audit.twice, audit.stale, audit.rerun_steps) == (0, 0, 0, 1)
    assert (audit.trained, audit.dropped) == (5, 1)
    # the same dump without the failed group's count: prompt 4 is lost
    write_dump(dump := tmp_path / "unaccounted.jsonl", [
        (1, [sample(0, 0), sample(1, 0)], {}),
        (2, [sample(2, 1), sample(3, 1)], {}),
        (3, [sample(6, 2)], {}),
    ])  # fmt: skip
    assert audit_rollout_dump(dump, max_lag=0, drawn=PROMPTS, held=[PROMPTS[5]]).lost == 1
    # a group that failed after the prompts `drawn` names (a crash cut the run short) hides no
    # lost prompt there and makes nothing negative
    failed_late = tmp_path / "rollouts.jsonl"  # the first dump: its failed group is prompt 4
    assert audit_rollout_dump(failed_late, max_lag=0, drawn=PROMPTS[:4], held=[]).lost == 0


def run_cell(tmp_path: Path, path: str, fault: str) -> dict:
    out = tmp_path / "matrix"
    proc = subprocess.run(
        [sys.executable, "benchmarks/fault_matrix.py", "--paths", path, "--engines", "2",
         "--faults", fault, "--steps", "6", "--timeout-s", "240", "--out", str(out),
         "--json", str(out / "rows.json")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert (out / "rows.json").exists(), f"fault_matrix.py wrote no rows:\n{proc.stdout[-3000:]}"
    return json.loads((out / "rows.json").read_text())[0]


@pytest.mark.stress
@pytest.mark.parametrize("path", ["async-disk", "sync-distributed"])
@pytest.mark.parametrize("fault", ["b", "c"], ids=["fault_mix", "engine_kill"])
def test_refit_under_faults_loses_repeats_and_stales_no_sample(tmp_path, path, fault):
    row = run_cell(tmp_path, path, fault)
    summary = {k: row.get(k) for k in ("exit", "steps", "lost", "twice", "stale", "versions")}
    assert row["exit"][-1] == "0" and row["steps"] == 6, summary
    assert (row["lost"], row["twice"], row["stale"]) == (0, 0, 0), summary
    assert row["versions"] == ["6", "6"], summary


@pytest.mark.stress
@pytest.mark.parametrize("fault", ["c", "w"], ids=["engine_kill", "worker_kill"])
def test_rollout_workers_under_faults_lose_repeat_and_stale_no_sample(tmp_path, fault):
    row = run_cell(tmp_path, "sync-workers", fault)
    summary = {k: row.get(k) for k in ("exit", "steps", "lost", "twice", "stale", "versions",
                                       "killed_workers")}  # fmt: skip
    assert row["exit"][-1] == "0" and row["steps"] == 6, summary
    assert (row["lost"], row["twice"], row["stale"]) == (0, 0, 0), summary
    assert row["versions"] == ["6", "6"], summary
    assert len(row["killed_workers"]) == (fault == "w"), summary  # the fault did strike
