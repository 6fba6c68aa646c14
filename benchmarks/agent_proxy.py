"""The agent proxy: per-call overhead at 64 concurrent sessions, and reward against the built-in
multi-turn path, side by side in one run.

1. Overhead: 64 concurrent conversations of `--turns` calls each on one local engine (a
   separate process), alternating in every repeat between calling the engine directly (token
   ids extended with `ChatTurns.appended_ids`, what `rollouts.multiturn` does) and 64 sessions
   of one proxy, each driven by its own `openai.AsyncOpenAI`. Same model, prompts, greedy
   sampling and output lengths (`min_new_tokens` = `max_new_tokens`). Reports the median
   per-call latency and the wall time of the whole round, and their ratio proxy / direct.
2. Reward (`--rl-steps N`, 0 skips it): `examples/agent_rl.py` (the calculator agent through
   the proxy) and `examples/run_tool_rl.py` (the built-in multi-turn env) from the same tool
   SFT checkpoint (`--model`), N steps each, one after the other; reward_mean per step and at
   equal wall time (training-loop time, from each run's metrics.jsonl).

    .venv/bin/python benchmarks/agent_proxy.py [--sessions 64] [--turns 3] [--repeats 3]
        [--rl-steps 30 --model runs/tool_sft_tiny/checkpoints/step_000800] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import openai
import trio

from engines import SGLangEngine, launch_engine
from rollouts.agent import open_agent_proxy
from rollouts.chat_turns import ChatTurns
from rollouts.generate_fn import GenerateContext
from rollouts.prompts import encode_prompt
from training.backend.pytorch import load_tokenizer
from training.backend.tiny_model import ensure_tiny_model


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": f"{100 + i}*{37 + i}"}]


async def direct_round(engine, chat, n: int, turns: int, params: dict) -> tuple[list, float]:
    """Per-call latencies and wall time of n concurrent conversations called directly."""
    latencies: list[float] = []

    async def one(i: int) -> None:
        ids = encode_prompt(chat.tokenizer, conversation(i))
        for t in range(turns):
            started = time.perf_counter()
            result = await engine.generate(ids, params)
            latencies.append(time.perf_counter() - started)
            follow = [{"role": "user", "content": f"turn {t}"}]
            ids = [*ids, *result.output_ids, *chat.appended_ids(result.output_ids, follow)]

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return latencies, time.perf_counter() - started


async def proxy_round(engine, chat, n: int, turns: int, params: dict) -> tuple[list, float]:
    """The same conversations through n sessions of one proxy, with the `openai` client.

    The proxy, sessions and clients are set up before the clock starts (an `AsyncOpenAI`
    builds an SSL context: setup, not per-call cost)."""
    latencies: list[float] = []
    limiter = trio.CapacityLimiter(n)

    async with open_agent_proxy(chat) as proxy, contextlib.AsyncExitStack() as stack:
        sessions, clients = [], []
        for i in range(n):
            ctx = GenerateContext(engine, params, limiter, f"bench-{i}", 0, chat.tokenizer)
            sessions.append(proxy.open_session(ctx, i))
            clients.append(
                await stack.enter_async_context(
                    openai.AsyncOpenAI(
                        base_url=sessions[i].base_url, api_key=sessions[i].api_key, max_retries=0
                    )
                )
            )

        async def one(i: int) -> None:
            messages = conversation(i)
            for t in range(turns):
                started = time.perf_counter()
                reply = await clients[i].chat.completions.create(model="p", messages=messages)
                latencies.append(time.perf_counter() - started)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"turn {t}"}]  # fmt: skip

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        took = time.perf_counter() - started
    # every call extended its session's one trajectory: nothing was re-rendered
    assert all(len(s.trajectory.branches) == 1 for s in sessions)
    return latencies, took


async def overhead(args: argparse.Namespace, model_dir: Path) -> tuple[str, list[str]]:
    chat = ChatTurns.from_tokenizer(load_tokenizer(model_dir))
    params = {"temperature": 0.0, "max_new_tokens": args.new_tokens,
              "min_new_tokens": args.new_tokens}  # fmt: skip
    extra = ["--num-threads", "1", "--max-running-requests", "256"]
    rows, per_call, wall = [], {"direct": [], "proxy": []}, {"direct": [], "proxy": []}
    async with (
        launch_engine(kind="local", model_path=model_dir, extra_args=extra) as launched,
        SGLangEngine(launched.url) as engine,
    ):
        await direct_round(engine, chat, 2, 1, params)  # warm up both sides
        await proxy_round(engine, chat, 2, 1, params)
        for _ in range(args.repeats):
            for side, fn in (("direct", direct_round), ("proxy", proxy_round)):
                lat, took = await fn(engine, chat, args.sessions, args.turns, params)
                per_call[side].append(statistics.median(lat))
                wall[side].append(took)
    for side in ("direct", "proxy"):
        rows.append([side, 1000 * harness.median(per_call[side]), harness.median(wall[side]),
                     ", ".join(f"{w:.2f}" for w in wall[side])])  # fmt: skip
    call_ratio = harness.median(per_call["proxy"]) / harness.median(per_call["direct"])
    wall_ratio = harness.median(wall["proxy"]) / harness.median(wall["direct"])
    head = (f"{args.sessions} concurrent sessions x {args.turns} calls, {args.new_tokens} new "
            f"tokens per call, tiny model, local engine (1 thread), median of {args.repeats}:")  # fmt: skip
    table = harness.md_table(["path", "median ms/call", "round wall s", "rounds (s)"], rows)
    notes = [f"- proxy / direct: per-call latency {call_ratio:.2f}x, round wall time "
             f"{wall_ratio:.2f}x (the proxy's own cost: HTTP + JSON + the openai client + "
             "rendering each call's new messages)"]  # fmt: skip
    return f"{head}\n\n{table}", notes


def rl_run(script: str, out: Path, args: argparse.Namespace) -> dict:
    """Run one RL example; its reward curve and loop wall time from metrics.jsonl."""
    cmd = [sys.executable, script, "--model", args.model, "--max-steps", str(args.rl_steps),
           "--output-dir", str(out), "--overwrite", f"train.eval_samples={args.eval_samples}",
           f"train.eval_every={args.rl_steps}", f"train.checkpoint_every={args.rl_steps}"]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=harness.REPO, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_mean" in r]
    return {"rewards": [r["reward_mean"] for r in rows],
            "elapsed": list(_cumsum(r.get("time_step_s", 0.0) for r in rows)),
            "summary": proc.stdout.strip().splitlines()[-1], "wall": time.perf_counter() - started}  # fmt: skip


def _cumsum(values):
    total = 0.0
    for v in values:
        total += v
        yield total


def reward_at(run: dict, t: float) -> float:
    """Mean reward of the last 5 steps finished by loop time t."""
    done = [r for r, e in zip(run["rewards"], run["elapsed"], strict=True) if e <= t]
    return statistics.fmean(done[-5:]) if done else float("nan")


def rewards(args: argparse.Namespace) -> tuple[str, list[str]]:
    base = harness.REPO / "runs" / "bench" / "agent_proxy"
    runs = {"agent proxy (examples/agent_rl.py)": rl_run("examples/agent_rl.py", base / "agent", args),
            "built-in multi-turn (examples/run_tool_rl.py)":
                rl_run("examples/run_tool_rl.py", base / "builtin", args)}  # fmt: skip
    horizon = min(r["elapsed"][-1] for r in runs.values())
    marks = [horizon * k / 4 for k in range(1, 5)]
    rows = [[name, len(r["rewards"]), r["elapsed"][-1] / len(r["rewards"]),
             *(reward_at(r, t) for t in marks)] for name, r in runs.items()]  # fmt: skip
    head = (f"GRPO on the tool task from `{args.model}`, {args.rl_steps} steps each, "
            "configs/agent_tiny.yaml vs configs/tool_tiny.yaml (same batch, limits, sampling); "
            "reward = mean reward_mean of the last 5 steps finished by each loop time:")  # fmt: skip
    table = harness.md_table(["path", "steps", "s/step",
                              *(f"reward@{t:.0f}s" for t in marks)], rows)  # fmt: skip
    notes = [f"- {name}: {r['summary']}" for name, r in runs.items()]
    return f"{head}\n\n{table}", notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rl-steps", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=100)
    parser.add_argument("--model", default="runs/tool_sft_tiny/checkpoints/step_000800")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        harness.apply_quick(args, parser, sessions=8, turns=2, repeats=1, rl_steps=0)
    started = time.time()
    model_dir = ensure_tiny_model(harness.REPO / "runs" / "tiny_model")
    parts, notes = [], []
    part, more = trio.run(overhead, args, model_dir)
    parts.append(part)
    notes += more
    if args.rl_steps:
        part, more = rewards(args)
        parts.append(part)
        notes += more
    harness.publish("agent_proxy", "Agent proxy: overhead and reward vs the built-in path",
                    "Agent proxy", parts, notes, quick=args.quick, started=started)  # fmt: skip


if __name__ == "__main__":
    main()
