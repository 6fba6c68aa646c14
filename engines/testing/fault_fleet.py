"""Supervised local engines, each behind its own `FaultProxy`: the fleet of the fault experiments
(examples/rl_engine_faults.py, benchmarks/fault_matrix.py, tests/test_fault_matrix.py).

    async with open_faulty_fleet(model_dir, [FaultPlan(), FaultPlan(rates=...)], log_dir) as fleet:
        urls = [m.proxy_url for m in fleet]  # what the trainer is given (engines.urls)
        os.kill(fleet[1].engine.current.pid, signal.SIGKILL)  # relaunched on its port

Each engine is relaunched on its own port when it dies (`engines.supervisor`), so its proxy keeps
pointing at it; `engine.url` reaches it without faults (e.g. to read its weight version).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from engines.supervisor import Supervision, supervise_engine
from engines.testing.fault_proxy import FaultPlan, FaultProxy


@dataclass
class FaultyEngine:
    engine: Supervision
    proxy: FaultProxy
    proxy_url: str


@contextlib.asynccontextmanager
async def open_faulty_fleet(model: str | Path, plans: Sequence[FaultPlan], log_dir: str | Path, *,
                            relaunch_delay_s: float = 0.5, max_relaunches: int = 3,
                            ) -> AsyncIterator[list[FaultyEngine]]:  # fmt: skip
    """One supervised local engine (weight version "0", one thread) per plan, each behind a
    proxy with that plan; the engines stop, then the proxies, when the block exits."""
    async with trio.open_nursery() as nursery, contextlib.AsyncExitStack() as stack:
        fleet = []
        for i, plan in enumerate(plans):
            engine = await stack.enter_async_context(supervise_engine(
                kind="local", model_path=str(model), log_path=Path(log_dir) / f"engine_{i}.log",
                relaunch_delay_s=relaunch_delay_s, max_relaunches=max_relaunches,
                extra_args=["--weight-version", "0", "--num-threads", "1"]))  # fmt: skip
            proxy = FaultProxy(engine.url, plan)
            fleet.append(FaultyEngine(engine, proxy, await nursery.start(proxy.serve)))
        try:
            yield fleet
        finally:
            await stack.aclose()  # stop the engines, then the proxies
            nursery.cancel_scope.cancel()


async def engine_weight_versions(fleet: Sequence[FaultyEngine], *, timeout_s: float = 10.0
                                 ) -> list[str | None]:  # fmt: skip
    """Each engine's `weight_version` from its GET /model_info (directly, not through its
    proxy); None for an engine that does not answer within `timeout_s`."""
    versions: list[str | None] = []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for member in fleet:
            try:
                answer = await client.get(f"{member.engine.url}/model_info")
                versions.append(str(answer.json().get("weight_version")))
            except (httpx.HTTPError, ValueError):
                versions.append(None)
    return versions
