"""RL recipe: the engines a run generates with and pushes weights to, from `config.engines`.

Live SGLang servers (`engines.urls`; vLLM servers with `engines.kind: vllm`), a gateway (`engines.router_url`, sgl-model-gateway), or
local engines launched and supervised here (relaunched when they die). `run_rl_recipe` opens
them with `open_engines`; everything else about the run is wired in training/recipes/rl.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from engines import EnginePool, LoraLaunch, SGLangEngine
from engines.client import EngineTimeouts
from engines.client_settings import client_options, client_settings, client_timeouts, pool_options
from engines.control_plane import GatewayControl, choose_control_plane, control_targets
from engines.refit import RefitGroup
from engines.router import RouterEngine
from engines.supervisor import supervise_engine
from engines.types import EngineTimeoutError, EngineUnavailableError
from engines.vllm import VLLMEngine
from plumbing.errors import ConfigError
from training.rl_config import EnginesConfig, RLRunConfig

log = logging.getLogger("rollouts.rl_recipe")


def local_engine_args(ec: EnginesConfig) -> list[str]:
    """The `rollouts serve` flags of an engine the recipe launches, from the `engines` section."""
    args = ["--weight-version", "0", "--max-running-requests", str(ec.max_running_requests),
            "--device", ec.local_device, "--dtype", ec.local_dtype]  # fmt: skip
    if ec.local_threads:
        args += ["--num-threads", str(ec.local_threads)]
    if not ec.local_prefix_cache:
        args.append("--disable-radix-cache")
    if ec.exact_logprobs:
        args.append("--exact-logprobs")
    return args


@contextlib.asynccontextmanager
async def open_engines(config: RLRunConfig, model_path: str, out: Path,
                       weights_copy: Any = None):  # fmt: skip
    """(generation engine, worker clients) for live URLs, a router, or local engines launched
    here (relaunched when they die, up to `engines.max_relaunches`; stopped at the end).

    Generation goes through an `EnginePool` of the workers, or through the gateway at
    `engines.router_url` (`RouterEngine`); weight syncs go to each worker, or through smg's
    `/v1/rl` control plane when the workers are out of reach (`engines.control_plane`). Every worker
    must run SGLang >= 0.5.6 (`SGLangEngine.check_server`). `weights_copy`: the pool's
    (`WeightsCopies`), so an engine back after a broadcast push gets the trainer's weights.
    """
    ec = config.engines
    settings = client_settings(ec)  # the workers' clients and pools are built from it too
    timeouts = client_timeouts(settings)
    # supervisors tell the pool at once when a local engine dies and when its relaunch is up
    engine_events_send, engine_events_recv = trio.open_memory_channel[tuple[str, str]](math.inf)
    async with contextlib.AsyncExitStack() as stack:
        urls = list(ec.urls)
        router = None
        if ec.router_url:
            gateway = SGLangEngine(ec.router_url, api_key=ec.api_key, timeouts=timeouts)
            router = await stack.enter_async_context(RouterEngine(gateway))
            urls = control_targets(urls or await router.list_workers())  # url@rank: one each
            if not urls:
                raise ConfigError(f"the router at {ec.router_url} lists no workers (GET /workers)")
            plane = await choose_control_plane(ec.control_plane, urls, api_key=ec.api_key)
            if plane == "gateway":  # only the gateway is reachable: syncs fan out through it
                control = GatewayControl(gateway)
                router.workers = [control]
                log.info("%s runs SGLang %s; weight syncs through its /v1/rl control plane",
                         ec.router_url, await router.check_server())  # fmt: skip
                yield router, [control]
                return
        elif not urls:
            for i in range(ec.n_local):
                launched = await stack.enter_async_context(supervise_engine(
                    kind="local", model_path=model_path, extra_args=local_engine_args(ec),
                    log_path=out / f"engine_{i}.log", startup_timeout_s=ec.startup_timeout_s,
                    max_relaunches=ec.max_relaunches, lora=lora_launch(config),
                    events=engine_events_send.clone(),
                ))  # fmt: skip
                urls.append(launched.url)
        if ec.kind == "vllm":  # given by URL only, no router, no LoRA (RLRunConfig refuses)
            yield await stack.enter_async_context(open_vllm_pool(ec, timeouts))
            return
        clients = [
            await stack.enter_async_context(SGLangEngine(
                u, **client_options(settings),
                retry_generate=router is not None))  # the pool retries (see SGLangEngine)
            for u in urls
        ]  # fmt: skip
        for client in clients:
            log.info("%s runs SGLang %s", client.url, await client.check_server())
            await resume_if_paused(client)
        pool = await stack.enter_async_context(
            EnginePool(
                clients,
                **pool_options(settings),
                engine_events=engine_events_recv,  # a relaunching engine gets no work
                weights_copy=weights_copy,  # one back after a broadcast push gets a disk copy
            )
        )
        if router is not None:  # the pool only watches the workers and gives returning ones
            router.workers = clients  # the current weights; generation goes via the gateway
            yield router, clients
        else:
            yield pool, clients


@contextlib.asynccontextmanager
async def open_vllm_pool(ec: EnginesConfig, timeouts: EngineTimeouts):
    """(EnginePool of the vLLM servers at `engines.urls`, their clients), each checked for the
    RL control routes (`VLLMEngine.check_server`) and resumed if a stopped trainer left it
    paused (vLLM's pause has no lease)."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(VLLMEngine(u, api_key=ec.api_key, timeouts=timeouts,
                                                       retry_generate=False))
            for u in ec.urls
        ]  # fmt: skip
        for client in clients:
            log.info("%s runs vLLM %s", client.url, await client.check_server())
            if await client.is_paused():
                log.warning("%s was left paused (a trainer stopped during a weight sync?): "
                            "resuming it", client.url)  # fmt: skip
                await client.resume()
        pool = await stack.enter_async_context(
            EnginePool(clients, **pool_options(client_settings(ec)))
        )
        yield pool, clients


async def probe_vllm_engines(urls: list[str], *, api_key: str | None, timeout_s: float = 10.0
                             ) -> None:  # fmt: skip
    """`probe_engines` for `engines.kind=vllm`: each URL answers with vLLM's RL control routes,
    or the run fails in seconds naming every URL and why."""
    timeouts = EngineTimeouts(connect_s=timeout_s, control_s=timeout_s, health_s=timeout_s)
    dead: list[str] = []
    for url in urls:
        async with VLLMEngine(url, api_key=api_key, timeouts=timeouts, max_retries=0) as engine:
            try:
                await engine.check_server()
            except (EngineUnavailableError, EngineTimeoutError) as err:
                dead.append(str(err))
    if dead:
        raise EngineUnavailableError(f"no vLLM server answers at engines.urls ({'; '.join(dead)})")


async def resume_if_paused(engine: SGLangEngine) -> bool:
    """Resume an engine left paused (a trainer killed during a weight sync), logging it.

    The local engine reports `paused` in `/server_info` (and ends a leased pause itself); SGLang
    reports no such field and has no lease, so an engine that does not say is resumed too
    (`/continue_generation` on a running SGLang engine changes nothing).

    Returns:
        Whether `/continue_generation` was sent.
    """
    states = (await engine.server_info()).get("internal_states") or [{}]
    paused = [s.get("paused") for s in states if isinstance(s, dict)]
    if paused and not any(p is None or p for p in paused):
        return False
    if any(paused):
        log.warning("%s was left paused (a trainer stopped during a weight sync?): resuming it",
                    engine.url)  # fmt: skip
    await engine.resume()
    return True


def lora_launch(config: RLRunConfig) -> LoraLaunch | None:
    """The engine flags that serve the policy's adapters (`model.lora`), or None.

    Room for the `keep` versions left loaded plus the base model in one batch (SGLang counts
    the base as one of `--max-loras-per-batch`).
    """
    lora = config.model.lora
    if lora is None:
        return None
    return LoraLaunch(max_lora_rank=lora.rank, target_modules=lora.target_modules,
                      max_loras_per_batch=lora.keep + 1)  # fmt: skip


@contextlib.asynccontextmanager
async def refit_group(engines: EnginesConfig) -> AsyncIterator[RefitGroup | None]:
    """The weight-update group of `engines.weight_transport: distributed` (None: disk), left
    by every engine when the run ends."""
    if engines.weight_transport != "distributed":
        yield None
        return
    group = RefitGroup(master_address=engines.weight_master_address,
                       backend=engines.weight_group_backend,
                       timeout_s=engines.weight_group_timeout_s,
                       broadcast_timeout_s=engines.weight_broadcast_timeout_s,
                       bucket_mb=engines.weight_bucket_mb)  # fmt: skip
    try:
        yield group
    finally:
        with trio.CancelScope(shield=True):
            await group.close()
