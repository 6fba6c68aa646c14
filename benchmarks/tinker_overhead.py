"""The cost of the Tinker API: one SL step through the `tinker` SDK and `rollouts tinker-serve`
vs the same step through the Python API the server calls, side by side in one run.

Both sides train their own LoRA model (rank 8, same seed) on the same fixed batch: the
Python side awaits `TinkerModel.forward_backward` + `optim_step` (rollouts/tinker_server/
trainer.py) in-process; the SDK side submits `forward_backward("cross_entropy")` +
`optim_step(AdamParams)` back to back and waits for both, over loopback HTTP (protobuf, zstd,
futures polled). Rounds alternate the two sides; the table gives the medians, the overhead,
and the SDK's HTTP requests per step (counted by the server, by route).

    .venv/bin/python benchmarks/tinker_overhead.py [--model DIR] [--steps 10] [--rounds 3]
        [--batch 8] [--tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tinker
import trio
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollouts.tinker_server.serve import open_tinker_server
from rollouts.tinker_server.trainer import ModelSpec, TinkerModel
from rollouts.tinker_server.wire import Datum
from training.backend.tiny_model import ensure_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="2 steps x 1 round")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 2, 1
    tmp = Path(tempfile.mkdtemp(prefix="tinker_overhead_"))
    model = str(args.model or ensure_tiny_model(tmp / "tiny"))
    rows = [[(5 + 7 * i + k) % 300 + 3 for k in range(args.tokens + 1)] for i in range(args.batch)]
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}

    box: dict = {}

    async def serve() -> None:
        async with open_tinker_server(model, tmp / "runs", num_threads=1) as server:
            box["server"] = server
            while "done" not in box:
                await trio.sleep(0.05)

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    while "server" not in box:
        time.sleep(0.05)
    server = box["server"]
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-bench")
    sdk = client.create_lora_training_client(base_model=model, rank=8, seed=0).result()
    batch = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                         loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * args.tokens})
             for r in rows]  # fmt: skip

    direct = TinkerModel.build(ModelSpec("direct", model, 8, 0), model, tmp / "direct",
                               adapter_name="direct")  # fmt: skip
    data = [Datum(r[:-1], {"target_tokens": np.array(r[1:]),
                           "weights": np.ones(args.tokens, "float32")})
            for r in rows]  # fmt: skip

    def sdk_steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fb = sdk.forward_backward(batch, "cross_entropy")
            opt = sdk.optim_step(types.AdamParams(**adam))
            fb.result(), opt.result()
            times.append(time.perf_counter() - t0)
        return times

    def direct_steps(n: int) -> list[float]:
        times: list[float] = []

        async def run() -> None:
            for _ in range(n):
                t0 = time.perf_counter()
                await direct.forward_backward(data, "cross_entropy", {}, False)
                await direct.optim_step(adam)
                times.append(time.perf_counter() - t0)

        trio.run(run)
        return times

    sdk_steps(2), direct_steps(2)  # warm both
    before = dict(server.service.request_counts)
    t_sdk, t_direct = [], []
    for _ in range(args.rounds):
        t_direct += direct_steps(args.steps)
        t_sdk += sdk_steps(args.steps)
    n = args.rounds * args.steps
    counts = {k: (v - before.get(k, 0)) / n for k, v in server.service.request_counts.items()
              if v - before.get(k, 0)}  # fmt: skip
    box["done"] = True
    direct.backend.close()
    md, ms = statistics.median(t_direct), statistics.median(t_sdk)
    print(f"model {model}, batch {args.batch} x {args.tokens} tokens, {n} steps per side")
    print("| side | median step (ms) |\n| --- | --- |")
    print(f"| Python API (TinkerModel, in-process) | {md * 1e3:.1f} |")
    print(f"| tinker SDK over HTTP | {ms * 1e3:.1f} |")
    print(f"overhead: {(ms - md) * 1e3:+.1f} ms per step ({ms / md:.2f}x)")
    print("SDK requests per step: " + ", ".join(f"{k.rsplit('/', 1)[-1]} {v:.1f}"
                                                for k, v in sorted(counts.items())))  # fmt: skip


if __name__ == "__main__":
    main()
