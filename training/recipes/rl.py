"""RL recipe glue: config → algorithm, start model, prompts, manager, loop wiring, summary.

`examples/run_rl.py` calls `run_rl_recipe`. The engines (launched local ones, live SGLang
servers, or a gateway) are opened by training/recipes/rl_engines.py; the policy, reference and
critic are built by training/recipes/rl_models.py. This module reads top to bottom as the
run: check inputs → algorithm schedule → start model → prompts → models → engines →
evaluate → `run_rl_training(objective=..., hooks=...)` → summary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from engines.client import probe_engines
from plumbing.errors import ConfigError
from plumbing.model_paths import resolve_model_dir
from rollouts.agent.harness import OpenAIAgent
from rollouts.generation import SampleTransform
from rollouts.openenv.server import serve_env_app
from rollouts.openenv.wire import check_server
from rollouts.prompts import load_prompt_jsonl
from rollouts.rewards import RewardFn
from rollouts.thinking import thinking_template_kwargs
from rollouts.tools import ToolParser
from training.backend.checkpoint import checkpoint_step, find_latest_checkpoint
from training.backend.lora import loadable_model_dir
from training.backend.model_io import check_model_path
from training.backend.pytorch import load_tokenizer
from training.config import SFTRunConfig, config_to_yaml, load_config
from training.data.buffer import DataBuffer
from training.loops.colocate import ColocatedRollouts, colocated_weights_dir, resume_engines
from training.loops.ema import resumed_metrics
from training.loops.hooks import CheckpointHook, RLHooks, StopFn
from training.loops.loggers import (
    ConsoleLogger,
    JsonlLogger,
    Logger,
    check_logger_extras,
    config_loggers,
    fan_out,
    format_metrics,
    shown_evals,
)
from training.loops.prometheus import open_prometheus
from training.loops.rl import run_rl_training
from training.loops.weight_push import (
    WeightsCopies,
    leave_engines_on_final_weights,
    push_weights,
)
from training.recipes.callables import resolve_callable as resolve_callable
from training.recipes.engine_model import model_served_by
from training.recipes.rl_engines import open_engines, probe_vllm_engines, refit_group
from training.recipes.rl_env import build_episode_setup, openenv_task_files, with_env_url
from training.recipes.rl_manager import build_rollout_manager, check_worker_extensions
from training.recipes.rl_models import build_rl_models
from training.recipes.rl_summary import EngineWatch, rl_console_keys
from training.recipes.rl_summary import RLSummary as RLSummary
from training.recipes.sft import check_input_file, sft_data_files
from training.recipes.sft_preamble import run_sft_preamble, same_recipe
from training.recipes.teacher import open_teacher
from training.rl import algorithms
from training.rl.advantages import AdvantageFn
from training.rl.algorithms import PolicyLossFn
from training.rl.kl import KLFn
from training.rl.objective import RLObjective
from training.rl.preference_loss import PairSelector, best_vs_worst
from training.rl.reference import ReferenceUpdateFn, check_lora_reference_rule, frozen
from training.rl.rollout_dump import RolloutDumpWriter
from training.rl_config import AlgorithmSection, RLRunConfig

log = logging.getLogger("rollouts.rl_recipe")


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
    if config.model.path is not None:  # a run or checkpoints directory: its latest model
        return resolve_model_dir(config.model.path)
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
    steps = sft.train.max_steps or _saved_extra(checkpoint).get("max_steps")  # null: epochs
    if steps is None or checkpoint_step(checkpoint) < steps:
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
    elif (tasks := openenv_task_files(config)) is not None:  # the env's task provider
        train_path, eval_path = tasks
    else:
        files = dc.write_task_files()
        train_path, eval_path = files.rl_train, files.rl_eval
    train = load_prompt_jsonl(train_path, tokenizer, max_prompt_len=dc.max_prompt_len, **kw)
    held = load_prompt_jsonl(eval_path, tokenizer, **kw) if eval_path else []
    return train, held[: config.train.eval_samples]


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
    if ec.urls and ec.kind == "vllm":
        await probe_vllm_engines(ec.urls, api_key=ec.api_key)
    elif ec.urls:
        await probe_engines(ec.urls, api_key=ec.api_key)
    if ec.router_url:
        await probe_engines([ec.router_url], api_key=ec.api_key, flag="--router-url")
    if config.env.openenv is not None and config.env.openenv.url is not None:
        await check_server(config.env.openenv.url)


def _closing(resource: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if resource is None else contextlib.closing(resource)


@dataclass(frozen=True)
class RLExtensions:
    """Extension points a program passes to `run_rl_recipe` (config files cannot name these).

    `reward_fn` replaces `config.reward.fn`; `transforms` shape each scored sample (e.g.
    `rollouts.shaping.add_shaping("length", length_bonus(-0.01))`); the rest go to
    `run_rl_training` as they are (`agent`, for `env.kind: agent`, is the program trained
    through the agent proxy; `tool_parser` replaces `env.parser`): the maths and reference rule in its `RLObjective`
    (`rl_objective`), `stop_fn` and `checkpoint_hook` in its `RLHooks`.
    """

    reward_fn: RewardFn | None = None
    transforms: tuple[SampleTransform, ...] = ()
    advantage_fn: AdvantageFn | None = None
    policy_loss_fn: PolicyLossFn = algorithms.compute_policy_loss
    kl_fn: KLFn | None = None
    pair_selector: PairSelector = best_vs_worst
    reference_update: ReferenceUpdateFn = frozen
    stop_fn: StopFn | None = None
    checkpoint_hook: CheckpointHook | None = None
    agent: OpenAIAgent | None = None  # env.kind agent: async (openai client, task) -> reward
    tool_parser: ToolParser | None = None


def rl_objective(config: RLRunConfig, schedule: algorithms.AlgorithmSchedule, reference: Any,
                 critic: Any, extensions: RLExtensions) -> RLObjective:  # fmt: skip
    """The objective `run_rl_training` optimizes: the configured algorithm and sampling, the
    models built for it, and the program's replacements for its maths."""
    return RLObjective(
        schedule, temperature=config.rollout.sampling.temperature,
        old_from_rollout=config.rollout.mode != "sync",  # overlap / async: engine logprobs
        reference=reference, reference_update=extensions.reference_update, critic=critic,
        advantage_fn=extensions.advantage_fn, policy_loss_fn=extensions.policy_loss_fn,
        kl_fn=extensions.kl_fn, pair_selector=extensions.pair_selector,
    )  # fmt: skip


async def run_rl_recipe(config: RLRunConfig, *, on_step: Logger | None = None,
                        extensions: RLExtensions = RLExtensions(),
                        config_dir: str | Path | None = None) -> RLSummary:  # fmt: skip
    """Everything `examples/run_rl.py` does.

    Args:
        on_step: an extra logger called after every step (e.g. a host app watching progress).
        extensions: custom reward, shaping, advantage, loss, KL, reference update, stop
            condition and checkpoint hook (defaults: as configured).
        config_dir: the config file's directory: `module:function` references in the config
            are looked for in the working directory, then there (training/recipes/callables.py).
    """
    server = config.env.openenv
    if server is not None and server.app is not None:  # serve it for the run, then run at its URL
        async with serve_env_app(server.app, startup_timeout_s=server.startup_timeout_s) as app:
            return await run_rl_recipe(with_env_url(config, app.url), on_step=on_step,
                                       extensions=extensions, config_dir=config_dir)  # fmt: skip
    t0 = time.perf_counter()
    check_worker_extensions(config, extensions)  # before anything starts
    await check_rl_inputs(config)
    check_logger_extras(config.logging)
    out = Path(config.output_dir)
    thinking = config.model.enable_thinking  # checked against the template by load_prompts
    episodes = build_episode_setup(
        config.env, config.reward, resolve=partial(resolve_callable, config_dir=config_dir),
        template_kwargs={} if thinking is None else {"enable_thinking": thinking},
        agent_section=config.agent, agent=extensions.agent, parser=extensions.tool_parser,
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
    out.mkdir(parents=True, exist_ok=True)  # only once the config and the prompts are valid
    (out / "config.yaml").write_text(config_to_yaml(config), encoding="utf-8")
    log.debug("resolved config:\n%s", config_to_yaml(config))
    buffer = DataBuffer(train_prompts, seed=config.data.shuffle_seed)
    backend, reference, critic = await trio.to_thread.run_sync(
        build_rl_models, config, model_path, tokenizer, schedule
    )
    if config.train.resume == "never":
        (out / "metrics.jsonl").unlink(missing_ok=True)
        (out / "rollouts.jsonl").unlink(missing_ok=True)
    jsonl = JsonlLogger(out / "metrics.jsonl")
    latest = find_latest_checkpoint(backend.checkpoint_dir)
    if config.train.resume != "never" and latest is not None:  # a row a kill lost (its eval)
        jsonl.restore_row(checkpoint_step(latest), resumed_metrics(backend.checkpoint_dir))
    dump = RolloutDumpWriter(out / "rollouts.jsonl") if config.train.dump_rollouts else None
    console = ConsoleLogger(config.train.max_steps, every=config.train.log_every,
                            keys=rl_console_keys(config.train.ema_metrics))  # fmt: skip
    loggers = [jsonl, console, *config_loggers(config.logging, out, config.model_dump(mode="json"))]
    with backend, _closing(critic), _closing(reference), contextlib.ExitStack() as closing, \
            _closing(dump):  # fmt: skip
        for logger in loggers:
            closing.callback(logger.close)
        weights = (colocated_weights_dir(out, model_bytes=_bytes_of(backend.model))
                   if config.engines.colocate else out / "weights")  # fmt: skip
        if weights != out / "weights":  # in memory: given back when the run ends
            closing.callback(shutil.rmtree, weights, True)
        copies = WeightsCopies(backend, weights)  # for engines back after a broadcast
        async with open_teacher(config.teacher, model_path, out) as teacher, \
                open_engines(config, model_path, out, copies) as (engine, clients), \
                refit_group(config.engines) as refit, \
                open_prometheus(config.train.prometheus) as prometheus:  # fmt: skip
            if config.engines.colocate:  # an engine a killed run left released: no weights
                await resume_engines(clients)
            if config.engines.urls or config.engines.router_url or config.engines.colocate:
                await push_weights(  # live (or colocated) engines: serve our start weights
                    backend, clients, weights, pause_mode=config.engines.pause_mode,
                    refit=refit, unavailable_timeout_s=config.engines.unavailable_timeout_s)  # fmt: skip

            async def evaluate() -> dict[str, float]:
                return await episodes.evaluate(engine, held_out, reward_fn, rollout=config.rollout,
                                               max_new_tokens=config.train.eval_max_new_tokens,
                                               tokenizer=tokenizer)  # fmt: skip

            before = await evaluate() if held_out else {}
            if held_out:
                log.info("held-out before RL (%d prompts): %s", len(held_out),
                         format_metrics(shown_evals(before), tuple(shown_evals(before))))  # fmt: skip
            else:  # an empty dict printed here read as a failed evaluation
                log.info("no held-out prompts: accuracy and reward are not measured before and "
                         "after RL (set data.eval_path=FILE, a prompts JSONL, to measure them)")  # fmt: skip
            manager = build_rollout_manager(  # in this process, or rollout.workers processes
                config, engine, clients, buffer, reward_fn=reward_fn, extensions=extensions,
                episodes=episodes, backend=backend, tokenizer=tokenizer,
                # distill: each sample scored by the teacher too
                generate_fn=teacher.wrap(episodes.generate_fn) if teacher else None,
            )  # fmt: skip
            if config.engines.colocate:  # the engines rest while the trainer trains
                manager = ColocatedRollouts(manager, clients, trainer=backend)

            watch = EngineWatch(engine)  # the engines lost, for the summary
            extra = [x for x in (prometheus, on_step) if x is not None]
            hooks = RLHooks(logger=fan_out(*loggers, watch, *extra),
                            evaluate_fn=evaluate if held_out else None,
                            stop_fn=extensions.stop_fn,
                            checkpoint_hook=extensions.checkpoint_hook, on_batch=dump)  # fmt: skip
            async with manager:
                history = await run_rl_training(
                    backend, buffer, manager, clients, config.train,
                    objective=rl_objective(config, schedule, reference, critic, extensions),
                    export_dir=weights, hooks=hooks,
                    pause_mode=config.engines.pause_mode,
                    resolved_config=config.model_dump(mode="json"), refit=refit,
                    unavailable_timeout_s=config.engines.unavailable_timeout_s,
                )  # fmt: skip
            version = backend.weight_version  # every engine that answers ends on it

            async def export() -> Path:  # the copy an engine that rejoined may already have had
                return Path((await copies(str(version)))[0])

            await leave_engines_on_final_weights(engine, clients, version, export,
                                                 timeout_s=config.engines.unavailable_timeout_s)  # fmt: skip
            watch(backend.step, {})  # the summary names the engines still down now
    last = history[-1] if history else {}
    curve = tuple(m.get("reward_mean", float("nan")) for m in history)
    return RLSummary(before.get("accuracy"), last.get("eval_accuracy"), backend.step,
                     time.perf_counter() - t0, find_latest_checkpoint(out / "checkpoints"), curve,
                     before.get("tool_use_rate"), last.get("eval_tool_use_rate"),
                     before.get("tool_success_rate"), last.get("eval_tool_success_rate"),
                     before.get("reward_mean"), last.get("eval_reward_mean"), watch.total,
                     watch.lost())  # fmt: skip


def _bytes_of(model: Any) -> int:
    """The size of `model`'s parameters (an export of it, in its dtype)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
