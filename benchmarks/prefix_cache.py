"""The local engine's radix prefix cache: generation throughput with it and without it, side by
side in one run (issue 25).

Two workloads, each against two local engine processes on the same model and thread count:
one as launched (prefix cache on) and one with `--disable-radix-cache`:
1. An rl_tiny rollout batch: 16 arithmetic prompts in the chat template, 8 samples each, sent
   as 128 concurrent single requests (what AsyncRolloutManager does), temperature 1, 8 new
   tokens. Sharing: the chat template's system/user prefix, and a group's samples.
2. Multi-turn tool episodes (tool_tiny's shape): 32 episodes of 3 turns; each turn's prompt is
   the previous prompt + the model's answer + a tool response, so turn k+1 extends turn k.
The sides alternate within every repeat (`--repeats`, medians), so load from other processes
hits both alike. Prints output tokens/s, the ratio with/without, and the cached share of
prompt tokens (`meta_info.cached_tokens` / `prompt_tokens`).

    .venv/bin/python benchmarks/prefix_cache.py [--size tiny|small] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import trio
from transformers import AutoTokenizer

from engines import SGLangEngine, launch_engine
from training.backend.tiny_model import build_tiny_model

SYSTEM = (
    "You are a careful assistant. Solve the arithmetic problem step by step, then give the "
    "final answer as a number on the last line. You may call the calculator tool with "
    '{"name": "calculator", "arguments": {"expression": "..."}} when a product is too long.'
)


def rl_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {a} + {b}?"}]  # fmt: skip
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text))
    return out


async def rl_batch(engine: SGLangEngine, prompts: list[list[int]], samples: int, new: int):
    """(output tokens/s, cached share of prompt tokens) for one batch of prompts x samples."""
    params = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
    produced = cached = prompt_tokens = 0

    async def one(prompt: list[int]) -> None:
        nonlocal produced, cached, prompt_tokens
        result = await engine.generate(prompt, params)
        produced += len(result.output_ids)
        cached += result.cached_tokens
        prompt_tokens += result.prompt_tokens

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            for _ in range(samples):
                nursery.start_soon(one, prompt)
    return produced / (time.perf_counter() - started), cached / max(1, prompt_tokens)


async def tool_episodes(engine: SGLangEngine, tokenizer, prompts, turns: int, new: int):
    """(output tokens/s, cached share) for multi-turn episodes: answer, tool result, answer."""
    params = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
    produced = cached = prompt_tokens = 0

    async def episode(i: int, prompt: list[int]) -> None:
        nonlocal produced, cached, prompt_tokens
        ids = list(prompt)
        for turn in range(turns):
            result = await engine.generate(ids, params)
            produced += len(result.output_ids)
            cached += result.cached_tokens
            prompt_tokens += result.prompt_tokens
            tool = f'<|im_end|>\n<|im_start|>tool\n{{"result": {i * 7919 + turn}}}<|im_end|>\n'
            ids += list(result.output_ids) + tokenizer.encode(tool + "<|im_start|>assistant\n")

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i, prompt in enumerate(prompts):
            nursery.start_soon(episode, i, prompt)
    return produced / (time.perf_counter() - started), cached / max(1, prompt_tokens)


async def run(args: argparse.Namespace, model_dir: Path) -> tuple[list[str], list[str]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = ["--num-threads", str(args.threads), "--max-running-requests", "128"]
    sides = {"with prefix cache": base, "without (--disable-radix-cache)": [*base,
             "--disable-radix-cache"]}  # fmt: skip
    results: dict[str, dict[str, list]] = {s: {"rl": [], "tools": []} for s in sides}
    async with (
        launch_engine(
            kind="local", model_path=model_dir, extra_args=sides[next(iter(sides))]
        ) as on,
        launch_engine(
            kind="local", model_path=model_dir, extra_args=list(sides.values())[1]
        ) as off,  # fmt: skip
        SGLangEngine(on.url) as engine_on,
        SGLangEngine(off.url) as engine_off,
    ):
        engines = dict(zip(sides, (engine_on, engine_off), strict=True))
        for e in engines.values():  # warm up
            await rl_batch(e, rl_prompts(tokenizer, 2, seed=99), 2, 2)
        for repeat in range(args.repeats):
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            prompts = rl_prompts(tokenizer, args.prompts, seed=repeat)  # new batch each repeat
            episodes = rl_prompts(tokenizer, args.episodes, seed=1000 + repeat)
            for side in order:
                results[side]["rl"].append(
                    await rl_batch(engines[side], prompts, args.samples, args.new_tokens)
                )
                results[side]["tools"].append(
                    await tool_episodes(engines[side], tokenizer, episodes, args.turns,
                                        args.turn_tokens))  # fmt: skip
    rows, ratios = [], {}
    for workload, title in (("rl", f"rl_tiny batch ({args.prompts} prompts x {args.samples} "
                                   f"samples, {args.new_tokens} new tokens)"),
                            ("tools", f"tool episodes ({args.episodes} x {args.turns} turns, "
                                      f"{args.turn_tokens} new tokens a turn)")):  # fmt: skip
        tps = {s: statistics.median(v[0] for v in results[s][workload]) for s in sides}
        share = {s: statistics.median(v[1] for v in results[s][workload]) for s in sides}
        on_side, off_side = list(sides)
        ratios[workload] = tps[on_side] / tps[off_side]
        for side in sides:
            rows.append([title, side, tps[side], f"{100 * share[side]:.0f} %"])
    head = (f"Prefix cache on vs off ({args.size} model, torch threads {args.threads}, "
            f"median of {args.repeats} alternating repeats):")  # fmt: skip
    table = harness.md_table(
        ["workload", "engine", "output tokens/s", "prompt tokens from cache"], rows
    )
    notes = [
        f"rl_tiny batch, with / without: {ratios['rl']:.2f}x; tool episodes: "
        f"{ratios['tools']:.2f}x.",
        "Same engine code both sides; only the cache differs. `cached_tokens` is SGLang's "
        "(prompt tokens served from the cache, at most the prompt minus one).",
    ]
    return [head, table], notes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: build)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        harness.apply_quick(args, parser, prompts=4, samples=2, episodes=4, repeats=1)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "model", seed=0, size=args.size)
        parts, notes = trio.run(run, args, model_dir)
    key = "prefix_cache" if args.size == "tiny" else f"prefix_cache_{args.size}"
    harness.publish(key, f"Local engine prefix cache on vs off ({args.size} model, issue 25)",
                    "", parts, notes, quick=args.quick, started=started)  # fmt: skip


if __name__ == "__main__":
    main()
