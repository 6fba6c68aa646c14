"""Run the local engine: bind, load the model on the worker thread, serve until cancelled.

`serve(config)` is the whole server as one trio task (`python -m engines.local` runs it);
`open_local_engine(...)` runs it inside your nursery and yields once it answers
`/health_generate`, which is how tests and the embedded default use it. The port is bound
before the model loads, so `/health` answers 503 until the model is ready (as SGLang does).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import trio

from plumbing.gc_pause import gc_paused

from .asgi import App
from .http11 import ConnectionLimits, serve_http
from .lora_api import register_lora_routes
from .native_api import register_native_routes
from .openai_api import register_openai_routes
from .refit_api import register_refit_routes
from .state import EngineState, LocalEngineConfig

logger = logging.getLogger(__name__)

# Sampling keys SGLang takes from generation_config.json (`--sampling-defaults model`).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class LocalEngineServer:
    """A running local engine: where it listens and what it serves."""

    url: str
    config: LocalEngineConfig
    state: EngineState


def build_app(state: EngineState) -> App:
    config = state.config
    app = App(config.api_key, config.admin_api_key, max_body_bytes=config.max_request_bytes)
    register_native_routes(app, state)
    register_lora_routes(app, state)
    register_refit_routes(app, state)
    register_openai_routes(app, state)
    return app


@contextlib.contextmanager
def _torch_threads(count: int | None):
    """Set torch's intra-op threads for the calling (model) thread only, restoring after."""
    if count is None:
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class _ThreadedRunner:
    """Wraps a ModelRunner so every call runs with the configured torch thread count."""

    def __init__(self, runner: Any, threads: int | None) -> None:
        self._runner, self._threads = runner, threads
        self.eos_ids = runner.eos_ids
        # for memory_occupation.py (the same objects: a release frees the runner's own)
        self.model, self.device, self.prefix = runner.model, runner.device, runner.prefix

    def step(self, keep, admit):
        with _torch_threads(self._threads):
            return self._runner.step(keep, admit)

    def rescore(self, exact: Any, seqs: list[Any]) -> list[Any]:
        with _torch_threads(self._threads):
            return exact(seqs)

    def load_weights(self, path: str) -> None:
        with _torch_threads(self._threads):
            self._runner.load_weights(path)

    def load_tensors(self, tensors: dict[str, Any]) -> None:
        with _torch_threads(self._threads):
            self._runner.load_tensors(tensors)

    def load_lora(self, name: str, path: str) -> None:
        with _torch_threads(self._threads):
            self._runner.load_lora(name, path)

    def delete_lora(self, name: str) -> None:
        self._runner.delete_lora(name)

    def reset(self) -> None:
        self._runner.reset()

    def flush_prefix_cache(self) -> None:
        self._runner.flush_prefix_cache()


def _load(config: LocalEngineConfig):
    """Runs on a worker thread: tokenizer, model, and the model's sampling defaults (with the
    cyclic collector paused: importing transformers and building the model only add live
    objects, ~0.7 CPU s of collector passes otherwise, plumbing/gc_pause.py)."""
    with gc_paused(), _torch_threads(config.num_threads):
        from transformers import AutoTokenizer, GenerationConfig

        from .params import ModelLimits
        from .runner import ModelRunner

        tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        runner = ModelRunner(
            config.model_path,
            dtype=config.dtype,
            device=config.device,
            seed=config.random_seed,
            max_prefix_cache_tokens=0
            if config.disable_radix_cache
            else config.max_prefix_cache_tokens,
        )
        if config.lora_enabled:
            _enable_lora(runner, config)
        exact = _exact_logprobs(runner, config)
    try:
        generation = GenerationConfig.from_pretrained(config.model_path).to_dict()
    except OSError:
        generation = {}
    defaults = {
        key: generation[key]
        for key in _GENERATION_DEFAULTS
        if generation.get(key) is not None and generation.get("do_sample", True)
    }
    limits = ModelLimits(
        vocab_size=runner.vocab_size, context_len=runner.context_len, sampling_defaults=defaults
    )
    return tokenizer, runner, limits, exact


def _exact_logprobs(runner: Any, config: LocalEngineConfig) -> Any:
    """The rescorer of `--exact-logprobs` (exact_logprobs.py), or None."""
    if not config.exact_logprobs:
        return None
    from .exact_logprobs import ExactLogprobs, resolve_scorer

    if config.lora_enabled:
        raise ValueError(
            "--exact-logprobs with LoRA serving: the trainer's adapter forward is not the "
            "engine's, so the logprobs would not be exact; drop one of --exact-logprobs and "
            "--enable-lora/--lora-paths"
        )
    return ExactLogprobs(runner.model, resolve_scorer(config.exact_logprobs_scorer))


def _enable_lora(runner: Any, config: LocalEngineConfig) -> None:
    """Wrap the model for LoRA and load `--lora-paths`, with SGLang's start-up checks
    (`arg_groups/lora_hook.py`, `lora_manager.py::init_lora_shapes`)."""
    from .lora_registry import LoraLoadError, parse_lora_paths
    from .lora_runner import read_adapter_config

    refs = parse_lora_paths(config.lora_paths)
    if config.max_loras_per_batch <= 0:
        raise ValueError("max_loras_per_batch must be positive")
    if not refs and not (config.max_lora_rank and config.lora_target_modules):
        raise ValueError(
            "When no initial --lora-paths is provided, you need to specify both --max-lora-rank "
            "and --lora-target-modules for LoRA initialization."
        )
    given = config.lora_target_modules or ()
    if "all" in given and len(given) != 1:
        raise ValueError(
            "If 'all' is specified in --lora-target-modules, it should be the only module "
            "specified."
        )
    if config.max_loaded_loras is not None and config.max_loaded_loras < config.max_loras_per_batch:
        raise ValueError(
            "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
            f"max_loaded_loras={config.max_loaded_loras}, "
            f"max_loras_per_batch={config.max_loras_per_batch}"
        )
    if config.max_loaded_loras is not None and config.max_loaded_loras < len(refs):
        raise ValueError(
            "The number of LoRA paths should not exceed max_loaded_loras. "
            f"max_loaded_loras={config.max_loaded_loras}, lora_paths={len(refs)}"
        )
    configs = {ref.lora_name: read_adapter_config(ref.lora_path) for ref in refs}
    rank = config.max_lora_rank or max((int(c["r"]) for c in configs.values()), default=0)
    modules: list[str] = list(config.lora_target_modules or [])
    if not modules:
        for c in configs.values():
            targets = c["target_modules"]
            modules += ["all"] if isinstance(targets, str) else list(targets)
    runner.enable_lora(rank, modules)
    for ref in refs:
        try:
            runner.load_lora(ref.lora_name, ref.lora_path)
        except LoraLoadError as exc:
            raise RuntimeError(f"Failed to load LoRA adapter {ref.lora_name}: {exc}") from exc


async def serve(
    config: LocalEngineConfig,
    *,
    task_status: trio.TaskStatus[LocalEngineServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled. `task_status.started(server)` once generation works."""
    from .scheduler import Scheduler

    state = EngineState(config)
    limits = ConnectionLimits(
        max_connections=config.max_connections,
        max_pre_auth_connections=config.max_pre_auth_connections,
        pre_auth_timeout_s=config.pre_auth_timeout_s,
        header_timeout_s=config.header_timeout_s,
        keep_alive_timeout_s=config.keep_alive_timeout_s,
        read_timeout_s=config.read_timeout_s,
        send_timeout_s=config.read_timeout_s,
    )
    async with trio.open_nursery() as nursery:
        parent = os.environ.get("ROLLOUTS_PARENT_PID", "")
        if parent.isdigit():
            nursery.start_soon(_exit_with_parent, int(parent))
        app = build_app(state)
        serve_app = partial(serve_http, admit=app.admits)
        binds = await nursery.start(
            serve_app, app, config.host, config.port, limits, state.http_stats
        )
        url = binds[0].replace("0.0.0.0", "127.0.0.1")
        logger.info("local engine listening on %s; loading %s", url, config.model_path)
        tokenizer, runner, limits, exact = await trio.to_thread.run_sync(_load, config)
        state.tokenizer, state.limits = tokenizer, limits
        state.model_type = getattr(runner.model.config, "model_type", "")
        state.architectures = list(getattr(runner.model.config, "architectures", None) or [])
        threaded = _ThreadedRunner(runner, config.num_threads)
        state.scheduler = Scheduler(
            threaded,
            state.decode,
            model_path=config.model_path,
            weight_version=config.weight_version,
            max_running_requests=config.max_running_requests,
            max_prefill_tokens=config.max_prefill_tokens,
            max_loras_per_batch=config.max_loras_per_batch,
            exact=None if exact is None else partial(threaded.rescore, exact),
        )
        state.lora = state.scheduler.lora = _lora_registry(state.scheduler, config)
        await nursery.start(state.scheduler.run)
        await nursery.start(state.pause_lease.run, state.scheduler)
        if not config.skip_server_warmup:
            await _warmup(state)
        state.ready.set()
        logger.info("The server is fired up and ready to roll! (%s)", url)
        task_status.started(LocalEngineServer(url=url, config=config, state=state))


def _lora_registry(scheduler: Any, config: LocalEngineConfig) -> Any:
    from .lora_registry import LoraRegistry, parse_lora_paths

    registry = LoraRegistry(
        scheduler,
        scheduler.runner,
        enabled=config.lora_enabled,
        max_loaded_loras=config.max_loaded_loras,
        max_loras_per_batch=config.max_loras_per_batch,
    )
    if config.lora_enabled:
        for ref in parse_lora_paths(config.lora_paths):
            registry.register_preloaded(ref)
    return registry


async def _exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Exit at once when the process that launched us is gone (it may have been SIGKILLed)."""
    while os.getppid() == parent_pid:
        await trio.sleep(poll_s)
    logger.error("parent process %d is gone; the local engine exits", parent_pid)
    os._exit(1)


async def _warmup(state: EngineState) -> None:
    from .params import GenerateItem
    from .sampling_params import SamplingParams

    item = GenerateItem(
        rid="warmup",
        input_ids=[0, 1, 2],
        params=SamplingParams(max_new_tokens=2, top_k=1),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=0,
        return_text_in_logprobs=False,
    )
    async with state.scheduler.submit([item], lock=False) as seqs:
        while not seqs[0].finished:
            await seqs[0].changed.wait()
    if seqs[0].error:
        raise RuntimeError(f"local engine warmup failed: {seqs[0].error}")


@contextlib.asynccontextmanager
async def open_local_engine(
    model_path: str, *, host: str = "127.0.0.1", port: int = 0, **options: Any
) -> AsyncIterator[LocalEngineServer]:
    """Run a local engine in the background of the caller's task; yield it once ready.

    Args:
        model_path: HF model directory.
        host, port: where to bind; port 0 picks a free port (see `server.url`).
        **options: any other `LocalEngineConfig` field (api_key, weight_version, ...).
    """
    config = replace(LocalEngineConfig(model_path=str(model_path)), host=host, port=port, **options)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve, config)
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()
