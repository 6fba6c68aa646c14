"""examples/run_rl.py paths a user takes: --engine-url against a live server, bad config."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from engines import launch_engine

ROOT = Path(__file__).parent.parent


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "run_rl.py"), *args],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def two_step_run(model_dir: Path, tmp_path: Path, *engine_args: str) -> subprocess.CompletedProcess:
    """Two RL steps of the tiny recipe with `engine_args` (--engine-url or --router-url ...)."""
    return run_cli(
        "--config", str(ROOT / "configs" / "rl_tiny.yaml"), *engine_args,
        "--model", str(model_dir), "--output-dir", str(tmp_path / "out"),
        "--max-steps", "2", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.filter_groups=none", "train.eval_samples=8", "backend.num_threads=1",
        "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
        f"data.task_dir={tmp_path / 'data'}", cwd=tmp_path,
    )  # fmt: skip


async def test_engine_url_trains_against_a_live_server_and_pushes_weights(tiny_model_dir, tmp_path):
    async with launch_engine(kind="local", model_path=tiny_model_dir,
                             extra_args=["--num-threads", "1"], startup_timeout_s=120) as server:  # fmt: skip
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
