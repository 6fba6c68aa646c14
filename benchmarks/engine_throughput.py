"""Local engine throughput vs HF `generate`, and the client's overhead, side by side in one run.

1. Output tokens/s of the local engine (`python -m engines.local`, a separate process, over
   HTTP) at 1, 8 and 64 concurrent requests, against serving the same kind of requests one at
   a time with HF `model.generate` in this process. Same model, same sampling (temperature 1,
   no top-k/top-p), same prompt and output lengths (EOS ignored), same torch thread count.
   Prints the ratio at 64 concurrent (target >= 5x).
2. Requests/s through `EnginePool` (SGLangEngine + parsing into GenerateResult) vs raw
   `httpx` posts of the same body (httpx's default client), against the same server, in
   alternating rounds (target >= 0.9x). Requests ask for 1 new token, so HTTP and the client,
   not the model, dominate.

Each measurement is repeated `--repeats` times, interleaved, and the median is reported, so
load from other processes on a shared machine hits both sides alike.

    .venv/bin/python benchmarks/engine_throughput.py [--size tiny] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import httpx
import torch
import trio

from engines import EnginePool, SGLangEngine, launch_engine
from training.backend.tiny_model import build_tiny_model


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def hf_sequential(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s serving the prompts one at a time with HF generate."""
    started, produced = time.perf_counter(), 0
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
            )
            produced += out.shape[1] - len(prompt)
    return produced / (time.perf_counter() - started)


async def engine_tokens_per_s(
    engine: SGLangEngine, prompts, new_tokens: int, concurrency: int
) -> float:
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
    limiter = trio.CapacityLimiter(concurrency)
    produced = 0

    async def one(prompt: list[int]) -> None:
        nonlocal produced
        async with limiter:
            result = await engine.generate(prompt, params)
        produced += len(result.output_ids)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    return produced / (time.perf_counter() - started)


async def requests_per_s(call, count: int, concurrency: int) -> float:
    limiter = trio.CapacityLimiter(concurrency)

    async def one(i: int) -> None:
        async with limiter:
            await call(i)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return count / (time.perf_counter() - started)


async def run(args: argparse.Namespace, model_dir: Path) -> str:
    """Both measurements; prints them and returns them as markdown for RESULTS.md."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    vocab = model.config.vocab_size
    seq_prompts = make_prompts(args.sequential_requests, args.prompt_len, vocab, seed=1)
    prompts = make_prompts(args.requests, args.prompt_len, vocab, seed=2)
    extra = ["--num-threads", str(args.threads), "--max-running-requests", "256"]

    async with (
        launch_engine(kind="local", model_path=model_dir, extra_args=extra) as launched,
        SGLangEngine(launched.url) as engine,
    ):
        await engine.generate(prompts[0], {"max_new_tokens": 4})  # warm up both sides
        hf_sequential(model, seq_prompts[:1], 4)
        hf, engine_tps = [], {1: [], 8: [], 64: []}
        for _ in range(args.repeats):
            hf.append(hf_sequential(model, seq_prompts, args.new_tokens))
            engine_tps[1].append(await engine_tokens_per_s(engine, seq_prompts, args.new_tokens, 1))
            for concurrency in (8, 64):
                engine_tps[concurrency].append(
                    await engine_tokens_per_s(engine, prompts, args.new_tokens, concurrency)
                )
        hf_median = statistics.median(hf)
        head1 = (
            f"Local engine vs HF generate ({args.size} model, prompts of {args.prompt_len} "
            f"tokens, {args.new_tokens} new tokens each, torch threads {args.threads}, "
            f"median of {args.repeats}):"
        )
        rows = [["HF generate, one request at a time", hf_median, 1.0]]
        for concurrency, values in engine_tps.items():
            value = statistics.median(values)
            rows.append([f"local engine, {concurrency} concurrent", value, value / hf_median])
        table1 = harness.md_table(["server", "output tokens/s", "vs HF generate"], rows)
        ratio = statistics.median(engine_tps[64]) / hf_median
        verdict1 = f"Batching gain at 64 concurrent: {harness.verdict(ratio, 5)}."
        print(f"\n{head1}\n{table1}\n{verdict1}")

        # ----- client overhead: the same tiny request through EnginePool and raw httpx -----
        body = {
            "input_ids": prompts[0][:4],
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
        }
        async with (
            # httpx's default limits (100 connections, 20 kept alive): what a user would write,
            # and fast; an unbounded keep-alive pool costs ~3x the client CPU per request.
            httpx.AsyncClient(base_url=launched.url) as raw,
            EnginePool([engine]) as pool,
        ):

            async def raw_call(i: int) -> None:
                response = await raw.post("/generate", json=body)
                response.raise_for_status()
                response.json()

            async def pool_call(i: int) -> None:
                await pool.generate(body["input_ids"], body["sampling_params"])

            # Many short alternating rounds: drift in machine load hits both sides alike.
            raw_rps, pool_rps = [], []
            per_round = max(1, args.overhead_requests // args.overhead_rounds)
            for _ in range(args.overhead_rounds):
                raw_rps.append(await requests_per_s(raw_call, per_round, args.overhead_concurrency))
                pool_rps.append(
                    await requests_per_s(pool_call, per_round, args.overhead_concurrency)
                )
        raw_median, pool_median = statistics.median(raw_rps), statistics.median(pool_rps)
        ratios = [p / r for p, r in zip(pool_rps, raw_rps, strict=True)]
        head2 = (
            f"Client overhead ({args.overhead_rounds} alternating rounds of {per_round} requests "
            f"of 1 new token each way, {args.overhead_concurrency} concurrent, medians):"
        )
        table2 = harness.md_table(
            ["client", "requests/s"],
            [["raw httpx", raw_median], ["EnginePool -> SGLangEngine", pool_median]],
        )
        verdict2 = (
            f"EnginePool / raw httpx: {harness.verdict(statistics.median(ratios), 0.9)} "
            f"(median of per-round ratios; range {min(ratios):.2f}-{max(ratios):.2f})."
        )
        print(f"\n{head2}\n{table2}\n{verdict2}")
    return f"{head1}\n\n{table1}\n\n{verdict1}\n\n{head2}\n\n{table2}\n\n{verdict2}\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="HF model dir (default: build one)"
    )
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64, help="requests at 8/64 concurrent")
    parser.add_argument(
        "--sequential-requests", type=int, default=12, help="for HF and 1 concurrent"
    )
    parser.add_argument("--overhead-requests", type=int, default=1600)
    parser.add_argument("--overhead-rounds", type=int, default=8)
    parser.add_argument("--overhead-concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: few requests, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        harness.apply_quick(
            args,
            parser,
            repeats=1,
            sequential_requests=4,
            new_tokens=16,
            overhead_requests=200,
            overhead_rounds=2,
        )
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "model", seed=0, size=args.size)
        body = trio.run(run, args, model_dir)
    harness.write_section("engine_throughput", "Local engine batching and client overhead", body,
                          quick=args.quick, started=started)  # fmt: skip


if __name__ == "__main__":
    main()
