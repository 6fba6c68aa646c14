"""The local engine under hostile load: do well-behaved clients still get served? (issue 15)

One engine (`python -m engines.local`, a separate process, `--api-key`, default bounds) on
loopback. Two phases, each `--duration` seconds:
1. clean: 64 well-behaved clients, each in a loop: /generate (16 new tokens), with the key;
2. abuse: the same 64 clients plus a bad mix running at the same time:
   - bad values (top_k -5, sampling_seed 2^64, n 10^6, stop id -1, broken / deep JSON),
   - unauthenticated 50 MB bodies (headers announce it, a trickle follows) and
     keyed bodies over the size cap,
   - slow heads: `--slow` connections trickling a header byte every second,
   - abandoners: start a 200-token generation and hang up after 0.2 s,
   - unauthenticated /health_generate callers.
Prints the good requests' p50/p99 latency in each phase and the ratio, their error count, what
the bad requests were answered, and the engine's RSS and open sockets sampled every 2 s (they
should stay flat). Stops by itself; loopback only.

    .venv/bin/python benchmarks/engine_abuse.py [--duration 120] [--slow 200] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import httpx
import trio

from engines import launch_engine
from training.backend.tiny_model import build_tiny_model

KEY = "bench-key"
# Each bad client pauses this long between requests: a steady hostile mix (~20 req/s per
# client), not a flood that would only measure who gets the 2 shared cores.
PAUSE_S = 0.05
AUTH = {"authorization": f"Bearer {KEY}"}
BAD_PARAMS = [
    {"top_k": -5},
    {"sampling_seed": 2**64},
    {"n": 10**6},
    {"stop_token_ids": [-1]},
    {"top_p": 0},
    {"logit_bias": {"3": float("inf")}},
]
BAD_RAW = [
    b"{not json",
    b"[" * 50_000,
    b'{"input_ids": [1], "sampling_params": {"n": ' + b"9" * 5000 + b"}}",
]


def engine_sample(pid: int) -> tuple[float, int]:
    """(RSS MiB, open sockets) of the engine process."""
    rss = float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed while we looked
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return rss, sockets


class Load:
    def __init__(self, url: str, port: int) -> None:
        self.url, self.port = url, port
        self.latencies: list[float] = []
        self.good_errors: Counter[str] = Counter()
        self.bad_answers: Counter[str] = Counter()

    async def good_client(self, seed: int, stop_at: float) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, headers=AUTH) as http:
            while time.monotonic() < stop_at:
                prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(4, 24))]
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16,
                        "ignore_eos": True, "temperature": 0.8}}  # fmt: skip
                started = time.perf_counter()
                try:
                    response = await http.post("/generate", json=body)
                except httpx.HTTPError as exc:
                    self.good_errors[type(exc).__name__] += 1
                    continue
                if response.status_code == 200:
                    self.latencies.append(time.perf_counter() - started)
                else:
                    self.good_errors[str(response.status_code)] += 1

    async def _answer(self, kind: str, send) -> None:
        try:
            response = await send()
            self.bad_answers[f"{kind} -> {response.status_code}"] += 1
        except httpx.HTTPError as exc:
            self.bad_answers[f"{kind} -> {type(exc).__name__}"] += 1

    async def bad_values(self, stop_at: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30, headers=AUTH) as http:
            while time.monotonic() < stop_at:
                params = random.choice(BAD_PARAMS)
                body = json.dumps({"input_ids": [1, 2], "sampling_params": params}).encode()
                await self._answer("bad value", lambda b=body: http.post("/generate", content=b))
                raw = random.choice(BAD_RAW)
                await self._answer("bad JSON", lambda r=raw: http.post("/generate", content=r))
                await self._answer("unauth health_generate",
                                   lambda: http.get("/health_generate", headers={"authorization": ""}))  # fmt: skip
                await trio.sleep(PAUSE_S)

    async def raw_request(self, head: bytes, trickle: int, stop_at: float, kind: str) -> None:
        """Send `head`, then up to `trickle` body bytes; record the status line answered."""
        while time.monotonic() < stop_at:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                async with stream:
                    await stream.send_all(head + b"x" * trickle)
                    with trio.fail_after(15):
                        answer = await stream.receive_some(4096)
                    self.bad_answers[f"{kind} -> {answer[:12].decode(errors='replace')}"] += 1
            except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                self.bad_answers[f"{kind} -> {type(exc).__name__}"] += 1
            await trio.sleep(PAUSE_S)

    async def slow_head(self, stop_at: float) -> None:
        """Trickle a request head one byte a second until the server closes the connection."""
        head = b"POST /generate HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 10_000
        while time.monotonic() < stop_at:
            opened = time.monotonic()
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                async with stream:
                    for byte in head:
                        await stream.send_all(bytes([byte]))
                        with trio.move_on_after(1.0):
                            if not await stream.receive_some(4096):
                                break
            except (OSError, trio.BrokenResourceError):
                pass
            self.bad_answers[f"slow head closed after {round(time.monotonic() - opened)} s"] += 1

    async def abandoner(self, stop_at: float) -> None:
        body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 200,
                           "ignore_eos": True}}).encode()  # fmt: skip
        head = b"POST /generate HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n" % KEY.encode()
        head += b"content-length: %d\r\n\r\n" % len(body)
        while time.monotonic() < stop_at:
            stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            async with stream:
                await stream.send_all(head + body)
                await trio.sleep(0.2)
            self.bad_answers["abandoned generation"] += 1


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def phase(url: str, port: int, pid: int, duration: float, abuse: bool, slow: int, series):
    load = Load(url, port)
    stop_at = time.monotonic() + duration
    started = time.monotonic()

    async def sample() -> None:
        while time.monotonic() < stop_at:
            rss, sockets = engine_sample(pid)
            series.append(("abuse" if abuse else "clean", time.monotonic() - started, rss, sockets))
            await trio.sleep(2.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        for i in range(64):
            nursery.start_soon(load.good_client, i, stop_at)
        if abuse:
            unauth = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 50000000\r\n\r\n"
            oversized = unauth.replace(
                b"host: x", b"host: x\r\nauthorization: Bearer " + KEY.encode()
            )
            for _ in range(4):
                nursery.start_soon(load.bad_values, stop_at)
                nursery.start_soon(load.raw_request, unauth, 65536, stop_at, "unauth 50 MB body")
                nursery.start_soon(load.raw_request, oversized, 65536, stop_at, "50 MB body, key")
                nursery.start_soon(load.abandoner, stop_at)
            for _ in range(slow):
                nursery.start_soon(load.slow_head, stop_at)
    # let the server close what the phase left (keep-alive 15 s) before the next one
    await trio.sleep(6.0)
    series.append(("after " + ("abuse" if abuse else "clean"), time.monotonic() - started,
                   *engine_sample(pid)))  # fmt: skip
    return load


async def run(args: argparse.Namespace) -> dict:
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="abuse-model-")), seed=0)
    extra = ["--num-threads", "1"]
    series: list[tuple] = []
    async with launch_engine(kind="local", model_path=model_dir, api_key=KEY,
                             extra_args=extra) as launched:  # fmt: skip
        clean = await phase(launched.url, launched.port, launched.pid, args.duration, False,
                            0, series)  # fmt: skip
        abuse = await phase(launched.url, launched.port, launched.pid, args.duration, True,
                            args.slow, series)  # fmt: skip
    return {"clean": clean, "abuse": abuse, "series": series}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds per phase")
    parser.add_argument("--slow", type=int, default=200, help="slow-head connections at once")
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 s phases")
    args = parser.parse_args()
    if args.quick:
        harness.apply_quick(args, parser, duration=10.0, slow=20)
    started = time.time()
    result = trio.run(run, args)
    clean, abuse, series = result["clean"], result["abuse"], result["series"]
    rows = []
    for name, load in (("clean (64 good clients)", clean), ("abuse (64 good + bad mix)", abuse)):
        lat = load.latencies
        rows.append([name, len(lat), sum(load.good_errors.values()),
                     percentile(lat, 0.5) * 1000, percentile(lat, 0.99) * 1000])  # fmt: skip
    ratio = percentile(abuse.latencies, 0.99) / percentile(clean.latencies, 0.99)
    table = harness.md_table(["phase", "good requests", "good errors", "p50 ms", "p99 ms"], rows)
    samples = [s for i, s in enumerate(series) if i % 5 == 0 or s[0].startswith("after")]
    over_time = harness.md_table(["phase", "t s", "engine RSS MiB", "open sockets"],
                                 [[p, round(t), rss, n] for p, t, rss, n in samples])  # fmt: skip
    answers = harness.md_table(["bad request -> answer", "count"],
                               sorted(abuse.bad_answers.items()))  # fmt: skip
    abuse_rss = [s[2] for s in series if s[0] == "abuse"]
    abuse_sockets = [s[3] for s in series if s[0] == "abuse"]
    notes = [
        f"- Good requests' p99 latency with the bad mix / without: **{ratio:.2f}x**; good-request"
        f" errors: clean {dict(clean.good_errors) or 0}, abuse {dict(abuse.good_errors) or 0}.",
        f"- Engine RSS during abuse: min {min(abuse_rss):.0f} / max {max(abuse_rss):.0f} MiB; open"
        f" sockets: min {min(abuse_sockets)} / max {max(abuse_sockets)} (--max-connections 512).",
        "- What the ratio holds: abandoners' generations are real model work until the hang-up"
        " is seen, and the bad clients share this process and the machine's cores with the"
        " good ones; refused requests themselves cost the engine no model step.",
        "- Engine: `python -m engines.local --num-threads 1 --api-key ...` with default bounds"
        " (header 10 s, keep-alive 15 s, 32 MiB bodies, n <= 256); clients in this process.",
    ]
    harness.publish("engine_abuse", "Local engine under hostile load (issue 15)",
                    "good clients, with and without the bad mix",
                    [table, over_time, answers], notes, quick=args.quick, started=started)  # fmt: skip


if __name__ == "__main__":
    main()
