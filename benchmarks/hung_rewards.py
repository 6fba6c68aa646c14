"""Issue 14: an RL run where 1 sample in 16 has a sync reward that never returns.

    .venv/bin/python benchmarks/hung_rewards.py [--steps 8]
    (cd <an older checkout> && <venv>/bin/python <this file>)   # the figures before the fix

Runs `run_rl_training` (in-process local engine, tiny model, 8 groups x 8 samples a step,
reward timeout 1 s) with a reward that blocks forever on one sample in 16 (the 6th sample of
every other prompt). Prints, per step, the samples that failed and the step's time, then
whether the run finished or how it ended. The hung threads are released at the end.
Self-contained on purpose: it must run inside older checkouts.
"""

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path.cwd()))
from engines import SGLangEngine
from engines.local import open_local_engine
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import prompt_item
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.backend.tiny_model import build_tiny_model
from training.config import OptimConfig
from training.data.buffer import DataBuffer
from training.loops.hooks import RLHooks
from training.loops.rl import run_rl_training
from training.rl.algorithms import grpo
from training.rl.batch import collate_rl
from training.rl.objective import RLObjective
from training.rl_config import RLLoopConfig

RELEASE = threading.Event()


def reward(sample) -> float:
    if int(sample.metadata["i"]) % 2 == 0 and sample.index_in_group == 5:
        RELEASE.wait()  # never returns while the run lasts
    return float(sample.index_in_group % 2)


async def main(steps: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="hung-rewards-"))
    model_dir = build_tiny_model(tmp / "model", seed=0)
    model, tok = load_model_and_tokenizer(model_dir)
    prompts = [prompt_item(tok, [{"role": "user", "content": f"{i}+{i}"}], {"i": str(i)})
               for i in range(4096)]  # fmt: skip
    buffer = DataBuffer(prompts, seed=0)
    backend = PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=1e-4, schedule="constant"), max_steps=steps,
        checkpoint_dir=tmp / "ck", pack_length=None,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip
    rollout = RolloutConfig(batch_size=8, n_samples_per_prompt=8, filter_groups="none",
                            reward_timeout_s=1.0, sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    rows = []

    def log(step, m):
        rows.append((step, m["samples_failed"], m["groups_failed"], m["time_step_s"]))
        print(f"step {step}: samples_failed={m['samples_failed']:.0f} "
              f"groups_failed={m['groups_failed']:.0f} time_step_s={m['time_step_s']:.1f}",
              flush=True)  # fmt: skip

    t0 = time.perf_counter()
    outcome = "finished"
    with backend:
        async with (
            open_local_engine(model_dir, num_threads=1) as server,
            SGLangEngine(server.url, max_retries=0) as engine,
        ):
            manager = AsyncRolloutManager(engine, buffer, rollout, reward_fn=reward,
                                          current_version=lambda: backend.weight_version)  # fmt: skip
            try:
                with trio.fail_after(60 * steps):
                    await run_rl_training(
                        backend, buffer, manager, [engine],
                        RLLoopConfig(max_steps=steps, checkpoint_every=1000),
                        objective=RLObjective(grpo()), export_dir=tmp / "w",
                        hooks=RLHooks(logger=log),
                    )  # fmt: skip
            except trio.TooSlowError:
                outcome = f"stuck: no end after {60 * steps} s"
            except Exception as err:  # the figure is how it ended
                outcome = f"ended at step {len(rows) + 1}: {type(err).__name__}: {err}"[:400]
    RELEASE.set()
    failed = sum(r[1] for r in rows)
    print(
        f"steps done: {len(rows)}/{steps}; samples failed in them: {failed:.0f}; "
        f"outcome: {outcome}; wall {time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    trio.run(main, parser.parse_args().steps)
