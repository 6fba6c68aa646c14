"""examples/run_rl.py paths a user takes: --engine-url against a live server, bad config.

The live server is a local engine served from this test's process (`open_local_engine`, the
server `rollouts serve` runs, on loopback HTTP): the CLI is another process either way, and an
engine process of its own would add ~3.5 CPU s of imports and nothing these tests check.
Launching engine processes is tests/test_engine_launch.py's."""

import json
import subprocess
from pathlib import Path

import httpx
import trio

from engines.local import open_local_engine
from tests import warm_python

ROOT = Path(__file__).parent.parent


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python examples/run_rl.py ARGS`, forked from the warm interpreter (tests/warm_python.py)."""
    return warm_python.run([ROOT / "examples" / "run_rl.py", *args], cwd=cwd, timeout=600)


def two_step_run(model_dir: Path, tmp_path: Path, *engine_args: str) -> subprocess.CompletedProcess:
    """Two RL steps of the tiny recipe with `engine_args` (--engine-url or --router-url ...)."""
    return run_cli(
        "--config", str(ROOT / "configs" / "rl_tiny.yaml"), *engine_args,
        "--model", str(model_dir), "--output-dir", str(tmp_path / "out"),
        "--max-steps", "2", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.filter_groups=none", "train.eval_samples=8", "backend.num_threads=1",
        "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
        f"data.task_dir={tmp_path / 'data'}", "data.arithmetic.n_rl=64",
        "data.arithmetic.n_eval=16", cwd=tmp_path,
    )  # fmt: skip


async def test_engine_url_trains_against_a_live_server_and_pushes_weights(tiny_model_dir, tmp_path):
    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        proc = await trio.to_thread.run_sync(
            lambda: two_step_run(tiny_model_dir, tmp_path, "--engine-url", server.url)
        )
        async with httpx.AsyncClient() as client:
            info = (await client.get(f"{server.url}/get_model_info")).json()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("RL done: heldout_accuracy before=")
    assert info["weight_version"] == "2"  # initial push (0), then one sync per step
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rows] == [1, 2]


def test_unknown_algorithm_preset_is_named(tmp_path):
    proc = run_cli("--config", str(ROOT / "configs" / "rl_tiny.yaml"), "algorithm.preset=ppo2",
                   cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "algorithm.preset" in proc.stderr


def no_model_run(tmp_path: Path, url: str) -> subprocess.CompletedProcess:
    """One step of the tiny recipe against `url`, with no --model (rl_tiny.yaml's model.path
    is null and its sft_config names the SFT recipe)."""
    tmp_path.mkdir()
    return run_cli(
        "--config", str(ROOT / "configs" / "rl_tiny.yaml"), "--engine-url", url,
        "--output-dir", str(tmp_path / "out"), "--max-steps", "1", "rollout.batch_size=2",
        "rollout.n_samples_per_prompt=2", "train.eval_samples=4", "backend.num_threads=1",
        f"data.task_dir={tmp_path / 'data'}", "data.arithmetic.n_rl=64",
        "data.arithmetic.n_eval=16", f"sft_config={ROOT / 'configs' / 'sft_tiny.yaml'}",
        cwd=tmp_path,
    )  # fmt: skip


async def test_engine_url_without_model_trains_the_engines_model_or_exits_2_naming_model(
    tiny_model_dir, tmp_path
):
    import shutil

    served = tmp_path / "served_model"
    shutil.copytree(tiny_model_dir, served)
    async with open_local_engine(served, num_threads=1) as server:
        shutil.rmtree(served)  # the engine keeps serving it; this machine has no copy now
        gone = await trio.to_thread.run_sync(no_model_run, tmp_path / "gone", server.url)
        shutil.copytree(tiny_model_dir, served)
        here = await trio.to_thread.run_sync(no_model_run, tmp_path / "here", server.url)
    assert gone.returncode == 2, gone.stderr[-3000:]
    assert "--model" in gone.stderr and str(served) in gone.stderr
    assert "SFT" not in gone.stderr and not (tmp_path / "gone" / "runs").exists()
    assert here.returncode == 0, here.stderr[-3000:]
    assert f"no --model: training the model {server.url} serves, {served}" in here.stderr
    assert "SFT" not in here.stderr and not (tmp_path / "here" / "runs" / "sft_tiny").exists()
    assert here.stdout.strip().splitlines()[-1].startswith("RL done: heldout_accuracy before=")
