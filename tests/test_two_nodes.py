"""Two torchrun nodes on this machine: torchrun's multi-node path (`--nnodes 2`, one process per
node, a c10d rendezvous on 127.0.0.1), the command README's "Two nodes" gives for real nodes.

The properties: SFT and RL run end to end across the two nodes (RL against the local engine
rank 0 starts, with weight pushes from disk), and both resume at world size 1 from the
checkpoints the two nodes wrote. SFT goes 1 → 2 → 1 (the two nodes resume a one-process
checkpoint, then one process resumes theirs), with exactly the losses and final weights of a
run that never stopped.

The SFT test (~30 s) is in `make test`; the RL one (~30 s more) is `stress` (`make stress`) to
keep `make test` short: RL differs from SFT here only by rank 0's engine and rollouts, which
tests/test_distributed.py's torchrun RL test already runs at world size 2 in `make test`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed_launch import ROOT, launch, launch_two_nodes


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").open())}


def check_nodes(nodes, done: str) -> None:
    """Both nodes succeeded, and exactly one ran the loop (rank 0 prints the summary)."""
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    finals = [n.stdout.strip().splitlines()[-1] for n in nodes if n.stdout.strip()]
    assert [f for f in finals if f.startswith(done)] and len(finals) == 1, finals


@pytest.mark.slow
def test_sft_resumed_across_worlds_1_2_1_has_the_one_process_losses_and_weights(
    tiny_model_dir, tmp_path
):
    """One SFT run checkpointed and resumed across world sizes: steps 1-2 in one process, 3-4
    on the two nodes (resuming a one-process checkpoint into FSDP2 shards), 5-6 in one process
    again (from the DCP shards the two nodes wrote). Its losses are those of a run that never
    stopped, and so are its final weights. (The warmup spans all six steps, so a run's
    --max-steps does not change its learning rates.)"""
    from transformers import AutoModelForCausalLM

    args = ["--config", str(ROOT / "configs" / "sft_tiny.yaml"), f"model.path={tiny_model_dir}",
            f"data.task_dir={tmp_path / 'data'}", "data.arithmetic.n_sft=400",
            "data.arithmetic.n_eval=32", "train.log_every=1", "train.eval_every=1000",
            "train.checkpoint_every=2", "train.eval_samples=16", "train.greedy_eval_samples=0",
            "backend.num_threads=1", "train.batch_size=16"]  # fmt: skip
    run, one = tmp_path / "mixed", tmp_path / "one"
    first = launch("examples/run_sft.py", *args, "--output-dir", str(run), "--max-steps", "2",
                   world=1, cwd=tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    nodes = launch_two_nodes("examples/run_sft.py", *args, "--output-dir", str(run),
                             "--max-steps", "4", "--resume", cwd=tmp_path)  # fmt: skip
    check_nodes(nodes, "SFT done")
    step4 = run / "checkpoints" / "step_000004"
    assert json.loads((step4 / "trainer_state.json").read_text())["world_size"] == 2
    assert (step4 / "dcp").is_dir()  # sharded by the two nodes
    resumed = launch("examples/run_sft.py", *args, "--output-dir", str(run), "--max-steps", "6",
                     "--resume", world=1, cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = launch("examples/run_sft.py", *args, "--output-dir", str(one), "--max-steps", "6",
                      world=1, cwd=tmp_path)  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    mixed, reference = losses(run), losses(one)
    assert sorted(mixed) == sorted(reference) == [1, 2, 3, 4, 5, 6]
    for step, loss in reference.items():
        assert mixed[step] == pytest.approx(loss, rel=1e-4), step
    final = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000006")
    expected = AutoModelForCausalLM.from_pretrained(one / "checkpoints" / "step_000006")
    for (name, a), b in zip(final.named_parameters(), expected.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5), name


@pytest.mark.stress
def test_rl_on_two_nodes_drives_the_engine_and_resumes_at_one_process(tiny_model_dir, tmp_path):
    run = tmp_path / "rl"
    args = ["--config", str(ROOT / "configs" / "rl_tiny.yaml"), "--model", str(tiny_model_dir),
            "--output-dir", str(run), "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
            "rollout.filter_groups=none", "train.eval_samples=8", "train.eval_every=1000",
            "train.checkpoint_every=2", "optim.lr=1e-3",
            "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
            f"data.task_dir={tmp_path / 'data'}", "data.arithmetic.n_rl=64",
            "data.arithmetic.n_eval=16"]  # fmt: skip
    nodes = launch_two_nodes("examples/run_rl.py", *args, "--max-steps", "2", cwd=tmp_path)
    check_nodes(nodes, "RL done")
    again = launch("examples/run_rl.py", *args, "--max-steps", "3", "--resume", world=1,
                   cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert sorted(p.name for p in (run / "weights").glob("v*")), "no weight push was exported"
