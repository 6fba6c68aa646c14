"""RL on two local engines while one is killed with SIGKILL mid-rollout, optionally behind proxies
that inject resets, delays, truncated bodies, 500s and hangs. Prints what was sent, trained,
dropped and relaunched, and checks that no trained sample was lost, duplicated or stale.

    python examples/rl_engine_faults.py [--max-steps 20] [--kill-at-step 5] [--faults]
        [--seed N] [--model DIR] [--output-dir runs/engine_faults]

The engines are supervised here (relaunched on their port when they die) and reached through
`engines.testing.fault_proxy` (faults on `/generate` only with --faults), both set up by
`engines.testing.fault_fleet`, so the run uses
`configs/rl_tiny.yaml` with `engines.urls` set to the proxies: the same pool, weight sync and
rejoin as `engines.n_local=2`. Without --model it trains a fresh tiny model (seed 0).
"""

import argparse
import os
import signal
import threading
import time
from functools import partial
from pathlib import Path

import trio

from engines.testing.fault_fleet import open_faulty_fleet
from engines.testing.fault_proxy import FaultPlan
from training.backend.tiny_model import build_tiny_model
from training.config import load_config
from training.recipes.rl import run_rl_recipe
from training.rl.rollout_dump import read_rollout_dump
from training.rl_config import RLRunConfig

FAULTS = {"reset": 0.03, "delay": 0.05, "truncate": 0.03, "500": 0.03, "hang": 0.02}


async def main(args: argparse.Namespace) -> None:
    out = Path(args.output_dir)
    model = args.model or str(build_tiny_model(out / "model", seed=0))
    rows: list[tuple[int, dict]] = []
    plans = [FaultPlan(rates=FAULTS if args.faults else {}, delay_s=1.0, hang_s=8.0,
                       seed=args.seed + i) for i in range(2)]  # fmt: skip
    async with open_faulty_fleet(model, plans, out) as fleet:
        engines = [m.engine for m in fleet]
        proxies = [m.proxy for m in fleet]
        urls = [m.proxy_url for m in fleet]
        config = load_config(RLRunConfig, "configs/rl_tiny.yaml", [
            f"engines.urls={urls}".replace("'", '"'), f"model.path={model}",
            f"output_dir={out}", f"train.max_steps={args.max_steps}", "train.eval_samples=0",
            "train.dump_rollouts=true", "rollout.filter_groups=none",
            "engines.generate_timeout_s=5", f"data.task_dir={out / 'data'}",
            "reward.fn=rollouts.tasks.arithmetic:digit_share_reward"])  # fmt: skip

        def on_step(step: int, metrics: dict) -> None:
            rows.append((step, dict(metrics)))
            if step == args.kill_at_step:  # the next batch's rollout starts right after this
                victim = engines[1].current.pid
                threading.Timer(0.05, os.kill, (victim, signal.SIGKILL)).start()
                print(f"step {step}: SIGKILL to engine 1 (pid {victim}) in 50 ms")

        t0 = time.perf_counter()
        summary = await run_rl_recipe(config, on_step=on_step)
        wall = time.perf_counter() - t0
    report(out, rows, summary.steps, wall, engines, proxies, config)


def report(out, rows, steps, wall, engines, proxies, config) -> None:
    batches = read_rollout_dump(out / "rollouts.jsonl")
    per_batch = config.rollout.batch_size * config.rollout.n_samples_per_prompt
    trained = [(step, s) for step, b in batches.items() for s in b.samples]
    ids = [(step, s.group_id, s.index_in_group) for step, s in trained]
    stale = [(step, s.weight_version) for step, s in trained if s.weight_version != step - 1]
    last = rows[-1][1]
    print(
        f"steps {steps} in {wall:.1f} s (max step {max(m['time_step_s'] for _, m in rows):.2f} s)"
    )
    print(f"trained samples {len(trained)} = {len(batches)} steps x {per_batch}: "
          f"{'yes' if len(trained) == len(batches) * per_batch else 'NO'}; "
          f"duplicated {len(ids) - len(set(ids))}; from older weights {len(stale)}")  # fmt: skip
    launched = sum(m["groups_launched"] for _, m in rows)
    accounted = sum(m["groups_launched"] - m["groups_filtered"] - m["groups_failed"]
                    - m["groups_returned_partial"] for _, m in rows)  # fmt: skip
    print(f"groups launched {launched:.0f}: trained {accounted:.0f} (= {steps} x "
          f"{config.rollout.batch_size}: {'yes' if accounted == steps * config.rollout.batch_size else 'NO'}), "
          f"dropped after engine failures {sum(m['groups_failed'] for _, m in rows):.0f}, "
          f"returned partial {sum(m['groups_returned_partial'] for _, m in rows):.0f}")  # fmt: skip
    sent = sum(last[f"engine{i}/samples_sent"] for i in range(len(engines)))
    received = sum(last[f"engine{i}/samples_received"] for i in range(len(engines)))
    print(
        f"samples sent {sent:.0f} (retries included), received {received:.0f}, trained "
        f"{len(trained)}: lost {received - len(trained):.0f} (no filter, no eval)"
    )
    for i, engine in enumerate(engines):
        back = [(step, m) for step, m in rows if m[f"engine{i}/rejoined"] > 0]
        if back:  # answers after its return; an answer from old weights would be "stale weights"
            step, m = back[0]
            after = last[f"engine{i}/done"] - m[f"engine{i}/done"]
            stale = last.get(f"engine{i}/failed/stale weights", 0)
            print(f"engine {i} back with the current weights by step {step}; requests it answered "
                  f"after that {after:.0f}, answers from old weights {stale:.0f}")  # fmt: skip
        kinds = {
            k.split("/")[-1]: int(v) for k, v in last.items() if k.startswith(f"engine{i}/failed/")
        }
        print(f"engine {i}: requests done {last[f'engine{i}/done']:.0f}, failed {kinds}, "
              f"relaunched {engine.relaunches}, rejoined with the current weights "
              f"{last[f'engine{i}/rejoined']:.0f}; proxy {dict(proxies[i].counts)}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--kill-at-step", type=int, default=5)
    parser.add_argument("--faults", action="store_true", help="inject faults on /generate")
    parser.add_argument("--seed", type=int, default=1, help="of the fault draws")
    parser.add_argument("--model", default=None)
    parser.add_argument("--output-dir", default="runs/engine_faults")
    trio.run(partial(main, parser.parse_args()))
