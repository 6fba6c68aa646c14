"""RL recipe glue: config → model, prompts, engines (launched or live), manager, loop, summary.

`examples/run_rl.py` calls `run_rl_recipe`. With `engines.urls` empty it launches (and
supervises) local engines on the starting checkpoint; with URLs it uses those live SGLang
servers, with `engines.router_url` it generates through sgl-model-gateway; weights go to each
worker by `/update_weights_from_disk`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from engines import EnginePool, LoraLaunch, SGLangEngine
from engines.client import EngineTimeouts, probe_engines
from engines.control_plane import GatewayControl, choose_control_plane, control_targets
from engines.router import RouterEngine
from engines.supervisor import supervise_engine
from rollouts.errors import ConfigError
from rollouts.evaluation import evaluate_greedy
from rollouts.generation import SampleTransform
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import load_prompt_jsonl
from rollouts.rewards import RewardFn
from rollouts.thinking import thinking_template_kwargs
from training.backend.checkpoint import checkpoint_step, find_latest_checkpoint
from training.backend.lora import loadable_model_dir
from training.backend.model_io import check_model_path
from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
from training.config import (
    LoraSettings,
    OptimConfig,
    SFTRunConfig,
    config_to_yaml,
    load_config,
)
from training.data.buffer import DataBuffer
from training.loops.loggers import ConsoleLogger, JsonlLogger, Logger, fan_out
from training.loops.rl import CheckpointHook, StopFn, push_weights, run_rl_training
from training.recipes.engine_model import model_served_by
from training.recipes.rl_env import build_episode_setup
from training.recipes.sft import check_input_file, sft_data_files
from training.recipes.sft_preamble import run_sft_preamble, same_recipe
from training.rl import algorithms
from training.rl.advantages import AdvantageFn
from training.rl.algorithms import PolicyLossFn
from training.rl.batch import collate_rl
from training.rl.critic import make_critic
from training.rl.kl import KLFn
from training.rl.reference import (
    ReferenceUpdateFn,
    check_lora_reference_rule,
    frozen,
    make_reference,
)
from training.rl.rollout_dump import RolloutDumpWriter
from training.rl_config import AlgorithmSection, RLRunConfig

log = logging.getLogger("rollouts.rl_recipe")


def resolve_callable(spec: str) -> Callable[..., Any]:
    """Import `module:function` once, at the edge (config files name extension points so)."""
    module, sep, name = spec.partition(":")
    if not sep:
        raise ConfigError(f"{spec!r}: expected 'module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"cannot resolve {spec!r}: {err}") from err


def generation_budget(config: RLRunConfig) -> int:
    """The most tokens the model may sample in one episode.

    One turn: `rollout.sampling.max_new_tokens`. Multi-turn (tools): the episode's
    `env.max_response_tokens` (all turns together), or max_turns × max_new_tokens without one.
    Length-aware algorithms measure against this (DAPO's overlong shaping, Dr.GRPO's constant
    normaliser), never against the per-turn limit.
    """
    per_turn = config.rollout.sampling.max_new_tokens
    if config.env.kind == "single_turn":
        return per_turn
    return config.env.max_response_tokens or config.env.max_turns * per_turn


def make_algorithm(preset: str, overrides: dict[str, Any], budget: int
                   ) -> algorithms.AlgorithmConfig:  # fmt: skip
    """A preset by name with overrides; length-aware presets get the generation budget."""
    factory = getattr(algorithms, preset, None)
    if factory is None or not callable(factory):
        raise ConfigError(f"unknown algorithm preset {preset!r}")
    kwargs = dict(overrides)
    if preset == "dapo":
        kwargs.setdefault("max_response_len", budget)
    if preset == "dr_grpo" or kwargs.get("aggregation") == "seq-mean-token-sum-norm":
        kwargs.setdefault("max_tokens_norm", budget)
    return factory(**kwargs)


def algorithm_schedule(section: AlgorithmSection, budget: int) -> algorithms.AlgorithmSchedule:
    """The configured preset (with overrides), then each of `section.switches` from its step.

    `budget` is the episode's generation budget (`generation_budget`).
    """
    first = make_algorithm(section.preset, section.overrides, budget)
    switches = {s.at_step: make_algorithm(s.preset, s.overrides, budget)
                for s in section.all_switches()}  # fmt: skip
    if not switches:
        return algorithms.constant_schedule(first)
    return algorithms.switch_at_steps(first, switches)


async def resolve_start_model(config: RLRunConfig) -> str:
    """`model.path`, the model live engines serve, or the SFT recipe's latest checkpoint
    (running the SFT recipe if missing: only for engines launched here)."""
    if config.model.path is not None:
        return config.model.path
    if config.engines.urls or config.engines.router_url:  # never an SFT run nobody asked for
        return await model_served_by(config.engines)
    if config.sft_config is None:
        raise ConfigError("model.path is null and sft_config is null: no model to start from")
    sft = load_config(SFTRunConfig, config.sft_config)
    latest = find_latest_checkpoint(Path(sft.output_dir) / "checkpoints")
    why = "is missing" if latest is None else sft_checkpoint_mismatch(latest, sft)
    if why is not None:
        log.info("the SFT checkpoint in %s %s: running the SFT recipe first", sft.output_dir, why)
        summary = await run_sft_preamble(sft)  # resumable: see sft_preamble.py
        log.info("%s", summary.line())
        latest = summary.checkpoint
    return str(loadable_model_dir(latest))


def sft_checkpoint_mismatch(checkpoint: Path, sft: SFTRunConfig) -> str | None:
    """Why `checkpoint` is not the finished result of recipe `sft` on its current data (None: it is).

    Compares the step count, the saved config (defaults of newer fields filled in) and the
    fingerprint of the data files (task files are regenerated, so a changed generator counts).
    """
    if checkpoint_step(checkpoint) < sft.train.max_steps:
        return "is unfinished"
    if not same_recipe(_saved_config(checkpoint), sft):  # train.log_every etc. aside
        return "was made with another config"
    if _saved_extra(checkpoint).get("data_sha256") != sft_data_files(sft).fingerprint():
        return "was trained on other data"
    return None


def _saved_extra(checkpoint: Path) -> dict[str, Any]:
    """The extra state saved with a checkpoint (config, data fingerprint; {}: unreadable)."""
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        return dict(state["extra"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _saved_config(checkpoint: Path) -> SFTRunConfig | None:
    """The config an SFT checkpoint was trained with, defaults filled in (None: unknown)."""
    try:
        return SFTRunConfig.model_validate(_saved_extra(checkpoint)["config"])
    except (ValueError, KeyError, TypeError):  # pydantic's ValidationError is a ValueError
        return None


def load_prompts(config: RLRunConfig, tokenizer: Any):
    """(train prompts, held-out prompts), rendered with `model.enable_thinking` if set."""
    dc = config.data
    kw = {"template_kwargs": thinking_template_kwargs(tokenizer, config.model.enable_thinking)}
    if dc.train_path is not None:
        train_path, eval_path = dc.train_path, dc.eval_path
    else:
        files = dc.write_task_files()
        train_path, eval_path = files.rl_train, files.rl_eval
    train = load_prompt_jsonl(train_path, tokenizer, max_prompt_len=dc.max_prompt_len, **kw)
    held = load_prompt_jsonl(eval_path, tokenizer, **kw) if eval_path else []
    return train, held[: config.train.eval_samples]


@contextlib.asynccontextmanager
async def open_engines(config: RLRunConfig, model_path: str, out: Path):
    """(generation engine, worker clients) for live URLs, a router, or local engines launched
    here (relaunched when they die, up to `engines.max_relaunches`; stopped at the end).

    Generation goes through an `EnginePool` of the workers, or through the gateway at
    `engines.router_url` (`RouterEngine`); weight syncs go to each worker, or through smg's
    `/v1/rl` control plane when the workers are out of reach (`engines.control_plane`). Every worker
    must run SGLang >= 0.5.6 (`SGLangEngine.check_server`).
    """
    ec = config.engines
    timeouts = EngineTimeouts(generate_s=ec.generate_timeout_s)
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
                args = ["--weight-version", "0", "--max-running-requests",
                        str(ec.max_running_requests)]  # fmt: skip
                if ec.local_threads:
                    args += ["--num-threads", str(ec.local_threads)]
                launched = await stack.enter_async_context(supervise_engine(
                    kind="local", model_path=model_path, extra_args=args,
                    log_path=out / f"engine_{i}.log", startup_timeout_s=ec.startup_timeout_s,
                    max_relaunches=ec.max_relaunches, lora=lora_launch(config),
                    events=engine_events_send.clone(),
                ))  # fmt: skip
                urls.append(launched.url)
        clients = [
            await stack.enter_async_context(SGLangEngine(
                u, api_key=ec.api_key, admin_api_key=ec.admin_api_key, timeouts=timeouts,
                retry_generate=router is not None))  # the pool retries (see SGLangEngine)
            for u in urls
        ]  # fmt: skip
        for client in clients:
            log.info("%s runs SGLang %s", client.url, await client.check_server())
            await resume_if_paused(client)
        pool = await stack.enter_async_context(
            EnginePool(
                clients,
                unavailable_timeout_s=ec.unavailable_timeout_s,
                stall_floor_s=ec.stall_floor_s,
                stall_s_per_token=ec.stall_s_per_token,
                engine_events=engine_events_recv,  # a relaunching engine gets no work
            )
        )
        if router is not None:  # the pool only watches the workers and gives returning ones
            router.workers = clients  # the current weights; generation goes via the gateway
            yield router, clients
        else:
            yield pool, clients


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


async def check_rl_inputs(config: RLRunConfig) -> None:
    """What can fail fast, before any model loads: input files, the model path, the engines.

    Raises:
        ConfigError: a data file is missing.
        ModelLoadError: `model.path` names no directory.
        EngineUnavailableError: nothing answers at an `--engine-url` / `--router-url`.
    """
    dc = config.data
    if dc.train_path is not None:
        check_input_file("data.train_path", dc.train_path)
    if dc.eval_path is not None:
        check_input_file("data.eval_path", dc.eval_path)
    if config.model.path is not None:
        check_model_path(config.model.path)
    ec = config.engines
    if ec.urls:
        await probe_engines(ec.urls, api_key=ec.api_key)
    if ec.router_url:
        await probe_engines([ec.router_url], api_key=ec.api_key, flag="--router-url")


def rl_backend(model_path: str | Path, *, checkpoint_dir: str | Path, max_steps: int,
               optim: OptimConfig | None = None, tokenizer: Any = None,
               micro_batch_tokens: int = 8192, keep_last: int | None = 2,
               num_threads: int | None = None, seed: int = 0, dtype: str = "float32",
               device: str = "cpu", lora: LoraSettings | None = None
               ) -> PyTorchTrainingBackend:  # fmt: skip
    """A `PyTorchTrainingBackend` that trains on RL batches (what `run_rl_training` needs).

    RL examples are one row per sample (or per group sharing a prompt), never packed SFT rows,
    so the backend batches with `collate_rl` and `pack_length=None`. Blocking (loads the
    model): from async code call it in a worker thread.

    Args:
        model_path: an HF model directory (or hub id); the tokenizer is loaded from it unless
            given.
        checkpoint_dir: where checkpoints go (and where resume looks).
        max_steps: the run's length (the LR schedule's horizon).
        optim: optimizer settings (default `OptimConfig()`).
        lora: train LoRA adapters on the model instead of all its weights (`model.lora`).
    """
    tokenizer = load_tokenizer(model_path) if tokenizer is None else tokenizer
    pad_id = tokenizer.pad_token_id
    return PyTorchTrainingBackend(
        partial(load_model, str(model_path), dtype=dtype, device=device), tokenizer,
        optim=optim or OptimConfig(), max_steps=max_steps, checkpoint_dir=checkpoint_dir,
        micro_batch_tokens=micro_batch_tokens, pack_length=None,
        collate_fn=partial(collate_rl, pad_id=pad_id), keep_last=keep_last,
        num_threads=num_threads, seed=seed, lora=lora,
    )  # fmt: skip


def build_rl_models(config: RLRunConfig, model_path: str, tokenizer: Any,
                    schedule: algorithms.AlgorithmSchedule) -> tuple[Any, Any, Any]:  # fmt: skip
    """(policy backend, reference or None, critic or None), as the schedule's algorithms need.

    Blocking (loads model copies): call it in a worker thread from async code.
    """
    out = Path(config.output_dir)
    backend = rl_backend(model_path, tokenizer=tokenizer, optim=config.optim,
                         max_steps=config.train.max_steps, checkpoint_dir=out / "checkpoints",
                         micro_batch_tokens=config.backend.micro_batch_tokens,
                         keep_last=config.train.keep_last, num_threads=config.backend.num_threads,
                         seed=config.backend.seed, dtype=config.model.dtype,
                         device=config.backend.device, lora=config.model.lora)  # fmt: skip
    steps = range(1, config.train.max_steps + 1)
    needs_ref = any(schedule(s, {}).needs_ref_logprobs for s in steps)
    reference = make_reference(backend) if needs_ref else None
    critic = None
    if any(schedule(s, {}).needs_critic for s in steps):
        critic_optim = config.critic_optim or config.optim.model_copy(
            update={"lr": config.optim.lr * 10}
        )
        critic = make_critic(model_path, tokenizer, optim=critic_optim,
                             max_steps=config.train.max_steps, checkpoint_dir=out / "critic",
                             micro_batch_tokens=config.backend.micro_batch_tokens,
                             keep_last=config.train.keep_last,
                             num_threads=config.backend.num_threads, dtype=config.model.dtype,
                             device=config.backend.device)  # fmt: skip
    return backend, reference, critic


def _closing(resource: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if resource is None else contextlib.closing(resource)


@dataclass(frozen=True)
class RLSummary:
    accuracy_before: float | None
    accuracy_after: float | None
    steps: int
    wall_time_s: float
    checkpoint: Path | None
    reward_curve: tuple[float, ...]
    tool_use_before: float | None = None  # share of episodes that called a tool (tool envs)
    tool_use_after: float | None = None
    tool_success_before: float | None = None  # share of tool calls that succeeded
    tool_success_after: float | None = None

    def line(self) -> str:
        def pct(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1%}"

        gain = ""
        if self.accuracy_before is not None and self.accuracy_after is not None:
            gain = f" ({(self.accuracy_after - self.accuracy_before) * 100:+.1f} points)"
        tools = ""
        if self.tool_use_before is not None:
            tools = (f" tool_use before={pct(self.tool_use_before)} "
                     f"after={pct(self.tool_use_after)} tool_success "
                     f"before={pct(self.tool_success_before)} "
                     f"after={pct(self.tool_success_after)}")  # fmt: skip
        return (
            f"RL done: heldout_accuracy before={pct(self.accuracy_before)} "
            f"after={pct(self.accuracy_after)}{gain}{tools} steps={self.steps} "
            f"wall_time={self.wall_time_s:.1f}s checkpoint={self.checkpoint}"
        )


@dataclass(frozen=True)
class RLExtensions:
    """Extension points a program passes to `run_rl_recipe` (config files cannot name these).

    `reward_fn` replaces `config.reward.fn`; `transforms` shape each scored sample (e.g.
    `rollouts.shaping.add_shaping("length", length_bonus(-0.01))`); the rest go to
    `run_rl_training` as they are.
    """

    reward_fn: RewardFn | None = None
    transforms: tuple[SampleTransform, ...] = ()
    advantage_fn: AdvantageFn | None = None
    policy_loss_fn: PolicyLossFn = algorithms.compute_policy_loss
    kl_fn: KLFn | None = None
    reference_update: ReferenceUpdateFn = frozen
    stop_fn: StopFn | None = None
    checkpoint_hook: CheckpointHook | None = None


async def run_rl_recipe(config: RLRunConfig, *, on_step: Logger | None = None,
                        extensions: RLExtensions = RLExtensions()) -> RLSummary:  # fmt: skip
    """Everything `examples/run_rl.py` does.

    Args:
        on_step: an extra logger called after every step (e.g. a host app watching progress).
        extensions: custom reward, shaping, advantage, loss, KL, reference update, stop
            condition and checkpoint hook (defaults: as configured).
    """
    t0 = time.perf_counter()
    await check_rl_inputs(config)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(config_to_yaml(config), encoding="utf-8")
    log.debug("resolved config:\n%s", config_to_yaml(config))
    thinking = config.model.enable_thinking  # checked against the template by load_prompts
    episodes = build_episode_setup(
        config.env, config.reward, resolve=resolve_callable,
        template_kwargs={} if thinking is None else {"enable_thinking": thinking},
    )  # fmt: skip
    reward_fn = extensions.reward_fn or episodes.reward_fn
    schedule = algorithm_schedule(config.algorithm, generation_budget(config))
    if config.model.lora is not None:  # refused now rather than after the models load
        check_lora_reference_rule(extensions.reference_update)
    model_path = await resolve_start_model(config)

    # Blocking set-up (tokenizer, prompts, model copies) in a worker thread: a host app's
    # other tasks keep running meanwhile.
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, model_path)
    train_prompts, held_out = await trio.to_thread.run_sync(load_prompts, config, tokenizer)
    buffer = DataBuffer(train_prompts, seed=config.data.shuffle_seed)
    backend, reference, critic = await trio.to_thread.run_sync(
        build_rl_models, config, model_path, tokenizer, schedule
    )
    if config.train.resume == "never":
        (out / "metrics.jsonl").unlink(missing_ok=True)
        (out / "rollouts.jsonl").unlink(missing_ok=True)
    jsonl = JsonlLogger(out / "metrics.jsonl")
    dump = RolloutDumpWriter(out / "rollouts.jsonl") if config.train.dump_rollouts else None
    console = ConsoleLogger(config.train.max_steps, every=config.train.log_every,
                            keys=("reward_mean", "accuracy", "eval_accuracy", "loss",
                                  "time_step_s", "weight_version"))  # fmt: skip
    with backend, _closing(critic), _closing(reference), contextlib.closing(jsonl), \
            contextlib.closing(console), _closing(dump):  # fmt: skip
        async with open_engines(config, model_path, out) as (engine, clients):
            if config.engines.urls or config.engines.router_url:  # live: serve our start weights
                await push_weights(
                    backend, clients, out / "weights", pause_mode=config.engines.pause_mode
                )

            async def evaluate() -> dict[str, float]:
                return await evaluate_greedy(engine, held_out, reward_fn,
                                             max_new_tokens=config.train.eval_max_new_tokens,
                                             generate_fn=episodes.generate_fn,
                                             tokenizer=tokenizer)  # fmt: skip

            before = await evaluate() if held_out else {}
            log.info("held-out before RL: %s", before)
            manager = AsyncRolloutManager(  # the loop gives it each step's algorithm
                engine, buffer, config.rollout, reward_fn=reward_fn,
                transforms=extensions.transforms, current_version=lambda: backend.weight_version,
                tokenizer=tokenizer, generate_fn=episodes.generate_fn,
            )  # fmt: skip

            async with manager:
                history = await run_rl_training(
                    backend, buffer, manager, clients, config.train, algorithm=schedule,
                    export_dir=out / "weights", temperature=config.rollout.sampling.temperature,
                    old_from_rollout=config.rollout.mode != "sync", reference=reference,
                    reference_update=extensions.reference_update, critic=critic,
                    advantage_fn=extensions.advantage_fn, policy_loss_fn=extensions.policy_loss_fn,
                    kl_fn=extensions.kl_fn, stop_fn=extensions.stop_fn,
                    checkpoint_hook=extensions.checkpoint_hook,
                    share_prompts=config.train.share_prompts,
                    logger=fan_out(jsonl, console, *([on_step] if on_step else [])),
                    evaluate_fn=evaluate if held_out else None,
                    pause_mode=config.engines.pause_mode, on_batch=dump,
                    resolved_config=config.model_dump(mode="json"),
                )  # fmt: skip
    last = history[-1] if history else {}
    curve = tuple(m.get("reward_mean", float("nan")) for m in history)
    return RLSummary(before.get("accuracy"), last.get("eval_accuracy"), backend.step,
                     time.perf_counter() - t0, find_latest_checkpoint(out / "checkpoints"), curve,
                     before.get("tool_use_rate"), last.get("eval_tool_use_rate"),
                     before.get("tool_success_rate"), last.get("eval_tool_success_rate"))  # fmt: skip
