"""A short RL run of the tiny recipe that can SIGKILL itself in the middle of an evaluation.

    python tests/rl_killed_in_eval.py MODEL_DIR WORK_DIR KILL_AT_STEP|never

Steps 1-3 (checkpoint and evaluation every 2), resumed from WORK_DIR/out when a checkpoint is
there, against a local engine served from this process. With a step, the first reward call
once that step's checkpoint exists is the evaluation's (sync mode: the step's checkpoint is
written, then it is evaluated) and kills the process as a hard kill would: nothing runs after.
"""

import os
import signal
import sys
from pathlib import Path

import trio

from engines.local import open_local_engine
from rollouts.tasks.arithmetic import digit_share_reward
from training.backend.checkpoint import checkpoint_step, find_latest_checkpoint
from training.config import load_config
from training.recipes.rl import RLExtensions, run_rl_recipe
from training.rl_config import RLRunConfig

ROOT = Path(__file__).resolve().parent.parent


async def main(model_dir: str, work: Path, kill_at: str) -> None:
    out = work / "out"

    def reward(sample):
        latest = find_latest_checkpoint(out / "checkpoints")
        if kill_at != "never" and latest is not None and checkpoint_step(latest) == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
        return digit_share_reward(sample)

    async with open_local_engine(model_dir, num_threads=1) as server:
        config = load_config(RLRunConfig, ROOT / "configs" / "rl_tiny.yaml", [
            f"model.path={model_dir}", f"engines.urls=[\"{server.url}\"]", f"output_dir={out}",
            "train.max_steps=3", "train.checkpoint_every=2", "train.eval_every=2",
            "train.eval_samples=4", "train.resume=auto", "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=2", "rollout.filter_groups=none",
            "backend.num_threads=1", f"data.task_dir={work / 'data'}", "data.arithmetic.n_rl=64",
            "data.arithmetic.n_eval=16",
        ])  # fmt: skip
        await run_rl_recipe(config, extensions=RLExtensions(reward_fn=reward))


if __name__ == "__main__":
    trio.run(main, sys.argv[1], Path(sys.argv[2]), sys.argv[3])
