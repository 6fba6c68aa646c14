"""Colocated mode under torchrun, for real: the RL recipe at 2 gloo ranks on CPU with a local
engine that releases its memory while the trainer trains.

The property: before the engines resume, every rank of the trainer gives its cached, unused
device memory back (`device_memory.give_back`, one backend operation on every rank), not rank 0
only: each rank's caching allocator holds its own freed activations, and the engines resume
into what the ranks left. Each step's metrics name the ranks that gave back before the resume.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed_launch import launch
from tests.torchrun_exit import rl_args

STEPS = 3


@pytest.mark.slow  # ~40 s: 3 recipe steps at 2 ranks and an engine
def test_every_rank_gives_its_cached_memory_back_before_the_colocated_engines_resume(
    tiny_model_dir, tmp_path, warm_python
):
    args = [a for a in rl_args(tiny_model_dir, tmp_path, steps=STEPS)
            if not a.startswith("algorithm.overrides.kl_coef")]  # no reference: not needed here  # fmt: skip
    proc = launch("examples/run_rl.py", *args, "engines.colocate=true", world=2, cwd=tmp_path,
                  warm=warm_python)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    given_back = [r.get("memory_resumed_trainer_ranks_given_back") for r in rows]
    print(f"ranks that gave their memory back before each step's resume: {given_back}")
    # step 1's batch came before any resume; each later one after a resume that both ranks
    # preceded with their give-back
    assert given_back == [None] + [2] * (STEPS - 1)
    assert all(r["memory_released_engines_weight_gib"] == 0.0 for r in rows)
