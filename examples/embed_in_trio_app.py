"""Embed RL training in your own trio application, wired by hand, and cancel it.

The app launches a local engine, builds the pieces (backend, prompts, rollout manager) from the
public API and runs `run_rl_training` in a nursery it owns beside a heartbeat task; it cancels
the training after a few steps and exits: the engine process is stopped, in-flight requests are
aborted, and the last complete checkpoint is left on disk, ready to load.

    python examples/embed_in_trio_app.py [--steps 3] [--output-dir runs/embed]
"""

import argparse
from pathlib import Path

import trio

from engines import SGLangEngine, launch_engine
from rollouts import AsyncRolloutManager, RolloutConfig, load_prompt_jsonl
from rollouts.tasks.arithmetic import digit_share_reward, write_arithmetic_datasets
from training import (
    DataBuffer,
    RLHooks,
    RLLoopConfig,
    RLObjective,
    ensure_tiny_model,
    find_latest_checkpoint,
    grpo,
    rl_backend,
    run_rl_training,
    setup_logging,
)


async def app(steps_before_cancel: int, out: Path) -> None:
    model = ensure_tiny_model("runs/tiny_model")
    backend = await trio.to_thread.run_sync(lambda: rl_backend(
        model, checkpoint_dir=out / "checkpoints", max_steps=1000))  # fmt: skip
    files = await trio.to_thread.run_sync(write_arithmetic_datasets, out / "data")
    prompts = DataBuffer(load_prompt_jsonl(files.rl_train, backend.tokenizer))
    rollout = RolloutConfig(batch_size=4, n_samples_per_prompt=4, filter_groups="none")
    heartbeats = 0

    async def heartbeat() -> None:  # the host app's own work, which must keep running
        nonlocal heartbeats
        while True:
            heartbeats += 1
            await trio.sleep(0.1)

    def watch(step: int, metrics: dict) -> None:
        print(f"host app saw step {step} (reward {metrics['reward_mean']:.3f})")
        if step >= steps_before_cancel:
            training.cancel()

    async with (
        launch_engine(model_path=model, extra_args=["--num-threads", "1"]) as server,
        SGLangEngine(server.url) as engine,
        AsyncRolloutManager(engine, prompts, rollout, reward_fn=digit_share_reward,
                            tokenizer=backend.tokenizer,
                            current_version=lambda: backend.weight_version) as manager,
        trio.open_nursery() as nursery,
    ):  # fmt: skip
        nursery.start_soon(heartbeat)
        with backend, trio.CancelScope() as training:
            await run_rl_training(backend, prompts, manager, [engine],
                                  RLLoopConfig(max_steps=1000, checkpoint_every=1),
                                  objective=RLObjective(grpo()), export_dir=out / "weights",
                                  hooks=RLHooks(logger=watch))  # fmt: skip
        nursery.cancel_scope.cancel()  # stop the heartbeat too: the app is done
    checkpoint = find_latest_checkpoint(out / "checkpoints")
    print(f"training cancelled after {steps_before_cancel} steps; heartbeats={heartbeats}; "
          f"last checkpoint={checkpoint}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output-dir", default="runs/embed")
    args = parser.parse_args()
    setup_logging()
    trio.run(app, args.steps, Path(args.output_dir))


if __name__ == "__main__":
    main()
