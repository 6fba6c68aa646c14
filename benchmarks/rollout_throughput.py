"""Rollout throughput: AsyncRolloutManager vs a plain trio + httpx loop, same engine, same requests.

One local engine (`python -m engines.local`, `--engine-threads` torch threads) serves all sides,
in alternating rounds; each round takes the next `--groups` RL prompts of the arithmetic task.
- manager: `AsyncRolloutManager.generate_batch()` through an `EnginePool`, as the RL recipe
  wires it: one batched `/generate` call per group (n token-id prompts, a rid per sample), a
  global concurrency limit, correctness rewards as samples finish, `Sample` records.
- raw httpx (batched): what one writes by hand for the same job: for each group, POST the same
  body (`input_ids` = the prompt n times, same sampling params, logprobs on, rids) with one
  `httpx.AsyncClient`, at most the same number of samples in flight, then score each sample
  inline with the same correctness check on the engine's text. This is the >= 0.9x target.
- raw httpx (per sample): the same, one request per sample (shown for scale: it is what
  batching per group saves).
Completions/s counts every sample produced; the median over `--rounds` is reported, with the
client process's CPU time per 1,000 completions (the engine is another process).

    .venv/bin/python benchmarks/rollout_throughput.py [--groups 64] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import httpx
import trio

from engines import EnginePool, SGLangEngine, launch_engine
from rollouts.config import RolloutConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import PromptItem, load_prompt_jsonl
from rollouts.tasks.arithmetic import correctness_reward, is_correct, write_arithmetic_datasets
from training.backend.pytorch import load_tokenizer
from training.backend.tiny_model import build_tiny_model
from training.data.buffer import DataBuffer

SIDES = {
    "manager": "AsyncRolloutManager (EnginePool)",
    "raw_batched": "raw trio + httpx, one request per group",
    "raw_per_sample": "raw trio + httpx, one request per sample",
}


async def with_manager(pool: EnginePool, prompts: list[PromptItem], config: RolloutConfig,
                       tok) -> int:  # fmt: skip
    manager = AsyncRolloutManager(pool, DataBuffer(prompts, shuffle=False), config,
                                  reward_fn=correctness_reward, tokenizer=tok)  # fmt: skip
    async with manager:
        batch = await manager.generate_batch()
    return sum(len(g) for g in batch.groups)


async def with_httpx(client: httpx.AsyncClient, prompts: list[PromptItem], config: RolloutConfig,
                     *, batched: bool) -> int:  # fmt: skip
    n, params = config.n_samples_per_prompt, config.sampling.params()
    limiter = trio.CapacityLimiter(
        config.max_concurrency // n if batched else config.max_concurrency
    )
    done = 0

    async def post(body: dict) -> list[dict]:
        async with limiter:
            response = await client.post("/generate", json=body)
        response.raise_for_status()
        out = response.json()
        return out if isinstance(out, list) else [out]

    async def group(g: int, prompt: PromptItem) -> None:
        nonlocal done
        if batched:
            rids = [f"raw-{g}-{i}" for i in range(n)]
            bodies = [{"input_ids": [list(prompt.prompt_ids)] * n, "sampling_params": params,
                       "return_logprob": True, "rid": rids}]  # fmt: skip
        else:
            bodies = [{"input_ids": list(prompt.prompt_ids), "sampling_params": params,
                       "return_logprob": True, "rid": f"raw-{g}-{i}"} for i in range(n)]  # fmt: skip
        results: list[dict] = []

        async def one(body: dict) -> None:
            results.extend(await post(body))

        async with trio.open_nursery() as nursery:
            for body in bodies:
                nursery.start_soon(one, body)
        answer = str(prompt.metadata["answer"])
        rewards = [float(is_correct(r["text"], answer)) for r in results]
        done += len(rewards)

    async with trio.open_nursery() as nursery:
        for g, prompt in enumerate(prompts):
            nursery.start_soon(group, g, prompt)
    return done


async def run(args, model_dir: Path, data_dir: Path) -> tuple[dict, dict]:
    tok = load_tokenizer(model_dir)
    files = write_arithmetic_datasets(data_dir, n_sft=10, n_rl=args.groups * args.rounds * 3,
                                      n_eval=10, min_digits=1, max_digits=2, ops="+")  # fmt: skip
    prompts = load_prompt_jsonl(files.rl_train, tok)
    config = RolloutConfig(batch_size=args.groups, n_samples_per_prompt=args.n,
                           max_concurrency=args.concurrency, filter_groups="none",
                           sampling={"max_new_tokens": args.max_new_tokens})  # fmt: skip
    extra = ["--num-threads", str(args.engine_threads), "--max-running-requests",
             str(args.concurrency)]  # fmt: skip
    rates: dict[str, list[float]] = {k: [] for k in args.sides}
    cpu: dict[str, list[float]] = {k: [] for k in args.sides}  # client CPU s per 1,000
    async with (
        launch_engine(kind="local", model_path=model_dir, extra_args=extra) as launched,
        SGLangEngine(launched.url) as engine,
        EnginePool([engine]) as pool,
        httpx.AsyncClient(base_url=launched.url, timeout=600) as client,
    ):
        await with_httpx(client, prompts[:4], config, batched=True)  # warm up
        cursor = 0
        for r in range(args.rounds):
            for side in args.sides[r % len(args.sides) :] + args.sides[: r % len(args.sides)]:
                chunk = prompts[cursor : cursor + args.groups]
                cursor += args.groups
                t0, c0 = time.perf_counter(), time.process_time()
                if side == "manager":
                    count = await with_manager(pool, chunk, config, tok)
                else:
                    count = await with_httpx(client, chunk, config, batched=side == "raw_batched")
                rates[side].append(count / (time.perf_counter() - t0))
                cpu[side].append((time.process_time() - c0) / count * 1000)
                print(f"  round {r + 1}/{args.rounds} {side}: {rates[side][-1]:.0f} completions/s",
                      flush=True)  # fmt: skip
    return rates, cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=64, help="prompts per round")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=128, help="samples in flight (rl_tiny)")
    p.add_argument("--engine-threads", type=int, default=1, help="rl_tiny's local_threads")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sides", default=",".join(SIDES), help=f"of: {', '.join(SIDES)}")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 groups, 1 round")
    args = p.parse_args()
    if args.quick:
        harness.apply_quick(args, p, groups=16, rounds=1)
    args.sides = args.sides.split(",")
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        rates, cpu = trio.run(run, args, model_dir, Path(tmp) / "data")
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med.get("raw_batched", float("nan"))
    rows = [[SIDES[k], med[k], med[k] / base, statistics.median(cpu[k]),
             ", ".join(f"{v:.0f}" for v in rates[k])] for k in args.sides]  # fmt: skip
    table = harness.md_table(["client", "completions/s", "vs raw (per group)",
                              "client CPU s / 1k", f"rounds ({args.rounds})"], rows)  # fmt: skip
    head = (f"{args.groups} groups x {args.n} samples per round, at most {args.max_new_tokens} "
            f"new tokens (tiny model), {args.concurrency} samples in flight, one local engine "
            f"with {args.engine_threads} torch thread(s); medians of {args.rounds} alternating "
            "rounds.")  # fmt: skip
    notes = []
    if "manager" in med and "raw_batched" in med:
        # paired by round: drift in the machine's load hits both sides of a round alike
        ratios = [m / r for m, r in zip(rates["manager"], rates["raw_batched"], strict=True)]
        notes.append(f"AsyncRolloutManager / raw httpx (same batched requests): "
                     f"{harness.verdict(statistics.median(ratios), 0.9)} (median of per-round "
                     f"ratios; range {min(ratios):.2f}-{max(ratios):.2f}).")  # fmt: skip
    harness.publish("rollout_throughput", "Rollout throughput vs raw httpx",
                    "Rollout throughput", [head, table], notes, quick=args.quick,
                    started=started)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
