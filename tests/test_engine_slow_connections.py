"""Slow and unauthenticated connections cannot lock keyed clients out (issue 26, item 4).

Before: every accepted socket took one of the 512 connection slots before its head or key
was read, so 600 idle sockets answered real clients 503. Now a connection waits in a small
lobby (oldest evicted, short head deadline) until its head is read and admitted.
Real engine (`open_local_engine`), raw sockets and httpx over loopback only.
"""

from __future__ import annotations

import resource
import time

import httpx
import trio

from engines.local import open_local_engine
from tests.test_engine_abuse import _raw, _read_until_closed

KEY = {"authorization": "Bearer k"}
GOOD = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4}}


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _good_requests(url: str) -> tuple[list[float], list[str]]:
    """25 keyed /generate requests at once, then 25 one after another: (latencies, errors)."""
    latencies: list[float] = []
    errors: list[str] = []

    async def one(http: httpx.AsyncClient) -> None:
        started = time.perf_counter()
        try:
            response = await http.post("/generate", json=GOOD, headers=KEY)
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)
            return
        if response.status_code == 200:
            latencies.append(time.perf_counter() - started)
        else:
            errors.append(str(response.status_code))

    async with httpx.AsyncClient(base_url=url, timeout=20) as http:
        async with trio.open_nursery() as nursery:
            for _ in range(25):
                nursery.start_soon(one, http)
        for _ in range(25):
            await one(http)
    return latencies, errors


async def test_600_idle_unauthenticated_sockets_do_not_lock_keyed_clients_out(tiny_model_dir):
    _raise_fd_limit(4096)
    async with open_local_engine(tiny_model_dir, num_threads=1, api_key="k") as server:
        clean, clean_errors = await _good_requests(server.url)
        connected = 0

        async def attacker() -> None:
            """Holds a socket open, a byte a second, and opens another when it is closed."""
            nonlocal connected
            while True:
                try:
                    stream = await _raw(server)
                except OSError:
                    await trio.sleep(0.5)
                    continue
                connected += 1
                async with stream:
                    try:
                        for byte in b"POST /generate HTTP/1.1\r\nx-slow: " + b"a" * 1000:
                            await stream.send_all(bytes([byte]))
                            with trio.move_on_after(1.0):
                                if not await stream.receive_some(4096):
                                    break
                    except trio.BrokenResourceError:
                        pass
                await trio.sleep(0.5)

        with trio.fail_after(90):  # ~14 s under 3 busy loops on 2 cores: a hang, not a slow run
            async with trio.open_nursery() as nursery:
                for _ in range(600):
                    nursery.start_soon(attacker)
                while connected < 600:
                    await trio.sleep(0.05)
                attacked, errors = await _good_requests(server.url)
                nursery.cancel_scope.cancel()
        print(
            f"\ngood clients, 50 keyed /generate: no attack p99 {_p99(clean) * 1000:.0f} ms, "
            f"errors {len(clean_errors)}; 600 slow sockets p99 "
            f"{_p99(attacked or [float('nan')]) * 1000:.0f} ms, errors {len(errors)}"
        )
        assert clean_errors == [] and errors == [], errors
        assert len(attacked) == 50
        assert server.state.http_stats.evicted_connections > 0  # the attack filled the lobby


async def test_a_connection_must_send_its_head_within_the_pre_auth_deadline(tiny_model_dir):
    async with open_local_engine(
        tiny_model_dir, num_threads=1, api_key="k", pre_auth_timeout_s=0.5
    ) as server:
        stream = await _raw(server)  # header_timeout_s is 10 s: the lobby's 0.5 s cuts first
        started = time.perf_counter()
        await _read_until_closed(stream, 5)
        assert time.perf_counter() - started < 3.0  # 2.5 s of room for a loaded machine


async def test_a_full_lobby_evicts_its_oldest_so_a_new_client_gets_through(tiny_model_dir):
    async with open_local_engine(
        tiny_model_dir, num_threads=1, api_key="k", max_pre_auth_connections=4
    ) as server:
        idle = [await _raw(server) for _ in range(4)]
        with trio.fail_after(5):
            while server.state.http_stats.pre_auth_connections < 4:
                await trio.sleep(0.01)
        await trio.sleep(1.1)  # a waiter is idle once 1 s in the lobby without a whole head
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            assert (await http.post("/generate", json=GOOD, headers=KEY)).status_code == 200
        assert await _read_until_closed(idle[0], 2) == b""  # the oldest made room
        assert server.state.http_stats.evicted_connections == 1


async def test_a_request_without_the_key_is_answered_401_and_its_connection_closed(
    tiny_model_dir,
):
    async with open_local_engine(tiny_model_dir, num_threads=1, api_key="k") as server:
        stream = await _raw(server)
        await stream.send_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")  # keep-alive asked
        answer = await _read_until_closed(stream, 3)
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
        assert server.state.http_stats.open_connections == 0  # never held a slot


async def test_a_burst_of_real_clients_larger_than_the_lobby_is_served_whole(
    tiny_model_dir, tmp_path
):
    # The agent proxy sends each session's call as its own request: a batch opens up to
    # rollout.max_concurrency (128) new connections at once, more than the lobby holds. They
    # all send their heads at once, but an engine in its own process accepts the whole burst
    # before it reads them. Evicting the oldest then closed real clients ("Server disconnected
    # without sending a response"), and the pool marked the engine down at every step of
    # examples/agent_rl.py. (An engine in this process would read each head before the next
    # connect: the burst needs a process of its own.)
    from engines import SGLangEngine, launch_engine

    async with launch_engine(kind="local", model_path=tiny_model_dir,
                             log_path=tmp_path / "engine.log",
                             extra_args=["--max-pre-auth-connections", "8",
                                         "--num-threads", "1"]) as server:  # fmt: skip
        for burst in (9, 24, 64):  # just over the lobby, 3x, 8x: each from a new client
            answered: list[int] = []
            async with SGLangEngine(server.url, max_retries=0) as engine:

                async def one(i: int, engine=engine, answered=answered) -> None:
                    result = await engine.generate([3, 4, 5 + i % 7], {"max_new_tokens": 2})
                    answered.append(len(result.output_ids))

                with trio.fail_after(60):
                    async with trio.open_nursery() as nursery:
                        for i in range(burst):
                            nursery.start_soon(one, i)
            assert answered == [2] * burst
    assert "lobby full" not in (tmp_path / "engine.log").read_text()
