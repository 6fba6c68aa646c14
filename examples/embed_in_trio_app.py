"""Embed RL training in your own trio application, next to your own tasks, and cancel it.

The app runs `run_rl_recipe` (engine launched, rollouts, training, weight sync, checkpoints) in
a nursery it owns beside a heartbeat task, cancels the training after a few steps, and exits:
the engine process is stopped, in-flight requests are aborted, and the last complete checkpoint
is left on disk, ready to load.

    python examples/embed_in_trio_app.py [--steps 3] [--output-dir runs/embed]
"""

import argparse
import logging
from pathlib import Path

import trio

from training.backend.checkpoint import find_latest_checkpoint
from training.backend.tiny_model import ensure_tiny_model
from training.config import load_config
from training.loops.loggers import setup_logging
from training.recipes.rl import run_rl_recipe
from training.rl_config import RLRunConfig

log = logging.getLogger("embed_example")
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


async def app(steps_before_cancel: int, output_dir: str) -> None:
    model = ensure_tiny_model("runs/tiny_model")
    config = load_config(RLRunConfig, CONFIGS / "rl_tiny.yaml", [
        f"model.path={model}", f"output_dir={output_dir}", "train.max_steps=1000",
        "train.checkpoint_every=1", "train.eval_samples=0", "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=4", "rollout.filter_groups=none",
        "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
    ])  # fmt: skip
    heartbeats = 0

    async def heartbeat() -> None:  # the host app's own work, which must keep running
        nonlocal heartbeats
        while True:
            heartbeats += 1
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        with trio.CancelScope() as training:

            def watch(step: int, metrics: dict) -> None:
                log.info("host app saw step %d (reward %.3f)", step, metrics["reward_mean"])
                if step >= steps_before_cancel:
                    training.cancel()

            await run_rl_recipe(config, on_step=watch)
        nursery.cancel_scope.cancel()  # stop the heartbeat too: the app is done
    checkpoint = find_latest_checkpoint(Path(output_dir) / "checkpoints")
    print(
        f"training cancelled after {steps_before_cancel} steps; heartbeats={heartbeats}; "
        f"last checkpoint={checkpoint}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output-dir", default="runs/embed")
    args = parser.parse_args()
    setup_logging()
    trio.run(app, args.steps, args.output_dir)


if __name__ == "__main__":
    main()
