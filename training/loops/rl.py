"""run_rl_training: the RL loop, a pure async function over stateful components.

It takes the components (backend, DataBuffer, rollout manager, engines), the loop's config, an
`RLObjective` (what is optimized: training/rl/objective.py) and `RLHooks` (who hears of each
step: training/loops/hooks.py). One step reads top to bottom: batch of groups
(AsyncRolloutManager) → algorithm for this step → `train_on_batch` (advantages, reference and
old logprobs of the same tokens if needed, then one or more forward_backward + optim_step:
training/rl/step.py) → every `sync_every` steps export weights and pause every engine; the
engines load the weights in the background (training/loops/weight_push.py; requests sent
meanwhile wait and run on the new weights) → maybe checkpoint → maybe eval → log (the
checkpoint first: an evaluation that fails never costs trained steps). All state lives in the
backend (weights, optimizer, versions), the DataBuffer (cursor + held groups) and the engines;
resume loads them.

Cancellation (Ctrl-C, a host app's cancel scope) propagates out of whatever await is running:
the rollout manager aborts its requests, the backend finishes the one queued op, and the last
complete checkpoint stays intact because checkpoints are renamed into place only when whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from engines.refit import RefitGroup
from plumbing.errors import CheckpointError, ConfigError, RolloutsError
from plumbing.nursery import open_nursery
from rollouts.debug import sample_line
from rollouts.generation import summarize_errors
from rollouts.types import RolloutBatch
from training.backend.checkpoint import checkpoint_name, find_latest_checkpoint
from training.backend.pytorch import PyTorchTrainingBackend
from training.data.buffer import DataBuffer
from training.loops.device_memory import TrainerMemory
from training.loops.ema import ema_metrics, resumed_metrics
from training.loops.hooks import RLHooks
from training.loops.sft import maybe_resume
from training.loops.weight_push import PendingPush, push_weights, start_push
from training.rl.objective import RLObjective
from training.rl.reference import (
    ReferenceUpdateFn,
    check_reference_rule,
    load_reference_state,
    reference_state,
)
from training.rl.signal import NoSignalWatch
from training.rl.step import train_on_batch as train_on_batch
from training.rl_config import RLLoopConfig

log = logging.getLogger("rollouts.rl")


async def run_rl_training(
    backend: PyTorchTrainingBackend,
    data_buffer: DataBuffer,
    rollout_manager: Any,
    engines: Sequence[Any],
    config: RLLoopConfig,
    *,
    objective: RLObjective,
    export_dir: str | Path,
    hooks: RLHooks = RLHooks(),
    pause_mode: str = "abort",
    resolved_config: dict[str, Any] | None = None,
    refit: RefitGroup | None = None,
    unavailable_timeout_s: float = 60.0,
) -> list[dict[str, Any]]:
    """Train with RL until `config.max_steps` optimizer steps are done (or a stop hook says stop).

    The reward is the rollout manager's (`AsyncRolloutManager(reward_fn=..., transforms=...)`);
    what is optimized is `objective`, who hears of it is `hooks`.

    Args:
        backend: the policy being trained; its checkpoint_dir is where resume looks.
        data_buffer: the prompts (the rollout manager draws from it); checkpointed with held
            groups, by `rollout_manager.data_state()` where it has one (the prompts it drew
            and no batch served yet are held there too: a resume trains them).
        rollout_manager: has `async generate_batch() -> RolloutBatch`; its `async settle()`, if
            it has one, is awaited before each weight push (see `AsyncRolloutManager.settle`),
            and its `use_algorithm(algorithm)`, if it has one, is called before the first batch
            and whenever the algorithm changes (reward shaping and group filtering follow the
            algorithm: `dapo()` gets its overlong penalty and dynamic sampling).
        engines: every engine that serves the policy; all receive each weight update.
        config: the loop's section of the run config (steps, sync/checkpoint/eval cadence,
            mini-batches, epochs, `share_prompts`, resume; `sample_every`: one sample's
            prompt, response and reward logged at the first step and every that many).
        objective: the algorithm (or schedule), reference, critic and replacement maths
            (`training.rl.objective.RLObjective`).
        export_dir: where exported weights go for the engines to load (same filesystem).
        hooks: logger, evaluation, stop condition, checkpoint / batch / algorithm-switch
            callbacks (`training.loops.hooks.RLHooks`); none by default.
        pause_mode: how a weight sync pauses the engines (`engines.pause_mode` of the config:
            abort, retract or in_place).
        resolved_config: the full run config, saved with each checkpoint.
        refit: push full weights by broadcast over this group (`engines.weight_transport:
            distributed`, training/loops/refit_push.py) instead of through `export_dir`.
        unavailable_timeout_s: how long a weight push whose engines are all down waits for one
            to come back before the run fails (`engines.unavailable_timeout_s`, the bound a
            request waits too).

    Returns:
        The metrics of each step this call ran.
    """
    schedule = objective.schedule()
    reference, critic = objective.reference, objective.critic
    check_rl_backend(backend)
    check_reference_rule(reference, objective.reference_update)
    export_root = Path(export_dir)
    start = await maybe_resume(backend, data_buffer, config)
    stateful_reference = objective.stateful_reference
    if start > 0 and stateful_reference is not None:  # the reference continues where it was too
        await _restore_reference(backend, stateful_reference, objective.reference_update)
    if start > 0 and critic is not None:
        await critic.load_checkpoint(critic.checkpoint_dir / checkpoint_name(start))
    if start > 0:  # the engines must serve the resumed weights, not the initial ones
        await push_weights(backend, engines, export_root, pause_mode=pause_mode, refit=refit,
                           unavailable_timeout_s=unavailable_timeout_s)  # fmt: skip
    history: list[dict[str, Any]] = []
    previous = resumed_metrics(backend.checkpoint_dir) if start > 0 else {}  # holds the EMAs
    empty_total = 0
    signal = NoSignalWatch(config.no_signal_steps)  # one warning when groups stop differing
    use_algorithm = getattr(rollout_manager, "use_algorithm", None)
    algo = schedule(start + 1, {})
    if use_algorithm is not None:
        use_algorithm(algo)

    async def save(step: int, metrics: dict[str, Any]) -> None:
        if critic is not None:  # first: `latest` of the policy implies its critic's
            await critic.save_checkpoint(step, metrics)
        data_state = getattr(rollout_manager, "data_state", data_buffer.state_dict)
        await _checkpoint(backend, step, metrics, data_state(), resolved_config, objective, hooks)

    memory = TrainerMemory(getattr(backend, "device", "cpu"))
    async with open_nursery() as pushes:  # waits for the last push before returning
        pending: PendingPush | None = None
        settle = getattr(rollout_manager, "settle", None)
        for step in range(start + 1, config.max_steps + 1):
            t0 = time.perf_counter()
            batch, skipped = await _generate_nonempty(rollout_manager, step,
                                                      config.max_empty_batches)  # fmt: skip
            empty_total += skipped
            t_generated = time.perf_counter()
            if hooks.on_batch is not None:
                hooks.on_batch(step, batch)
            if config.sample_every and (step == start + 1 or step % config.sample_every == 0):
                log.info(
                    "step %d sample: %s", step, _first_sample_line(batch, backend)
                )  # watchable
            metrics: dict[str, Any] = dict(batch.metrics)
            if not algo.needs_teacher:  # distillation's signal is per token, not reward spread
                metrics |= signal.observe(step, batch)
            memory.start()  # the trainer's GPU peak while it trains (device_memory.py)
            metrics |= await train_on_batch(backend, batch, algo,
                                            temperature=objective.temperature,
                                            old_from_rollout=objective.old_from_rollout,
                                            reference=reference,
                                            advantage_fn=objective.advantage_fn,
                                            policy_loss_fn=objective.policy_loss_fn,
                                            kl_fn=objective.kl_fn,
                                            share_prompts=config.share_prompts,
                                            mini_batches=config.mini_batches,
                                            epochs=config.epochs, critic=critic,
                                            pair_selector=objective.pair_selector)  # fmt: skip
            if reference is not None:
                update = partial(objective.reference_update, reference, backend, step,
                                 dict(metrics))  # fmt: skip
                metrics |= await reference.call(update).result() or {}
            t_trained = time.perf_counter()
            metrics |= memory.metrics("memory_train")
            sync_s = 0.0
            if step % config.sync_every == 0 or step == config.max_steps:
                if pending is not None:  # one push at a time (the last one is long done, as a rule)
                    await pending.done.wait()
                    metrics["time_sync_engines_s"] = pending.engines_s
                if settle is not None:  # overlap mode: the batch being generated ends first
                    await settle()
                    metrics["time_wait_generation_s"] = time.perf_counter() - t_trained
                t_push = time.perf_counter()
                pending = await start_push(backend, engines, export_root, pushes,
                                           pause_mode=pause_mode, refit=refit,
                                           unavailable_timeout_s=unavailable_timeout_s)  # fmt: skip
                sync_s = time.perf_counter() - t_push
            metrics |= {
                "empty_batches_skipped": skipped,
                "empty_batches_total": empty_total,
                "algorithm": algo.name,
                "weight_version": backend.weight_version,
                "time_generate_s": t_generated - t0,
                "time_train_s": t_trained - t_generated,
                "time_sync_s": sync_s,  # export + pause; the engines load in the background
                "time_step_s": time.perf_counter() - t0,
            }
            metrics |= ema_metrics(previous, metrics, config.ema_metrics, config.ema_decay)
            previous = metrics
            # The checkpoint comes before the evaluation: a failing evaluation (or a crash in
            # it) never costs the steps trained since the last one. It has no eval_* metrics.
            saved = step % config.checkpoint_every == 0 or step == config.max_steps
            try:
                if saved:
                    await save(step, metrics)
                if hooks.evaluate_fn is not None and (
                    step % config.eval_every == 0 or step == config.max_steps
                ):
                    metrics |= {f"eval_{k}": v for k, v in (await hooks.evaluate_fn()).items()}
            finally:
                # Even when cancelled here (Ctrl-C during the evaluation, or just as the save
                # ended): a step whose checkpoint exists must have its row, since a resume
                # from it logs only later steps. A row without a checkpoint is harmless: the
                # resume replaces rows after its own checkpoint.
                if hooks.logger is not None:
                    hooks.logger(step, metrics)
            history.append(metrics)
            upcoming = schedule(step + 1, metrics)
            if upcoming != algo and step < config.max_steps:
                log.info("algorithm from step %d: %s", step + 1, upcoming.name)
                if use_algorithm is not None:
                    use_algorithm(upcoming)
                if hooks.on_algorithm_switch is not None:
                    hooks.on_algorithm_switch(upcoming)
            algo = upcoming
            stop = hooks.stop_fn is not None and hooks.stop_fn(step, metrics)
            if stop and not saved:
                await save(step, metrics)
            if stop:
                log.info("stop_fn ended the run after step %d", step)
                break
    return history


async def _generate_nonempty(rollout_manager: Any, step: int, max_empty: int
                             ) -> tuple[RolloutBatch, int]:  # fmt: skip
    """The next batch with at least one group, and how many empty ones were skipped before it.

    A batch is empty when every group was rejected: each of its samples failed (a reward that
    raised, returned a list, read a missing field; an engine error) or every group was filtered
    (no reward spread under dynamic sampling). It cannot be trained on; it is logged with the
    samples' errors and skipped. `max_empty` in a row end the run with the same message.

    Raises:
        RolloutsError: `max_empty` batches in a row were empty; names why.
    """
    for skipped in range(max_empty):
        batch = await rollout_manager.generate_batch()
        if batch.groups:
            return batch, skipped
        why = _why_empty(batch)
        log.warning("step %d: rollout batch skipped (%d in a row): %s", step, skipped + 1, why)
    raise RolloutsError(
        f"step {step}: {max_empty} rollout batches in a row had no group to train on "
        f"(train.max_empty_batches={max_empty}); the last one: {why}"
    )


def _first_sample_line(batch: RolloutBatch, backend: PyTorchTrainingBackend) -> str:
    """The first group's first sample (`rollouts.debug.sample_line`), and its group's rewards."""
    group = batch.groups[0]
    rewards = " ".join(f"{s.reward:.3g}" for s in group)
    tokenizer = getattr(backend, "tokenizer", None)
    return f"{sample_line(group[0], tokenizer)}; its group's rewards: {rewards}"


def _why_empty(batch: RolloutBatch) -> str:
    m = batch.metrics
    counts = (f"no group accepted of {m.get('groups_launched', 0):.0f} launched "
              f"({m.get('groups_failed', 0):.0f} with failed samples, "
              f"{m.get('groups_filtered', 0):.0f} filtered out for equal rewards)")  # fmt: skip
    if batch.failures:
        return f"{counts}; sample errors: {summarize_errors(batch.failures)}"
    return counts


def check_rl_backend(backend: PyTorchTrainingBackend) -> None:
    """Refuse a backend built for SFT (packed rows, SFT collate) before any rollout is made."""
    if backend.pack_length is not None or backend._collate == backend._collate_sft:
        raise ConfigError(
            "run_rl_training: this backend batches SFT samples (PyTorchTrainingBackend's "
            "defaults pack_length=256, collate_fn=None); build it with "
            "training.rl_backend(model_path, checkpoint_dir=..., max_steps=...), or pass "
            "pack_length=None, collate_fn=partial(collate_rl, pad_id=tokenizer.pad_token_id)"
        )


async def _checkpoint(backend: PyTorchTrainingBackend, step: int, metrics: dict[str, Any],
                      data_state: dict[str, Any], resolved_config: dict[str, Any] | None,
                      objective: RLObjective, hooks: RLHooks) -> None:  # fmt: skip
    extra = {"data_buffer": data_state, "config": resolved_config or {}}
    tensors = {}
    reference = objective.stateful_reference
    if reference is not None:
        state = partial(reference_state, reference, objective.reference_update)
        tensors["reference"] = await reference.call(state).result()
    path = await backend.save_checkpoint(step, metrics, extra_state=extra, extra_tensors=tensors)
    if hooks.checkpoint_hook is not None:
        hooks.checkpoint_hook(step, path, metrics)


async def _restore_reference(backend: PyTorchTrainingBackend, reference: PyTorchTrainingBackend,
                             rule: ReferenceUpdateFn) -> None:  # fmt: skip
    """Load the reference saved with the checkpoint the policy resumed from."""
    latest = find_latest_checkpoint(backend.checkpoint_dir)
    extra = await trio.to_thread.run_sync(backend.read_extra_tensors, latest)
    if "reference" not in extra:
        raise CheckpointError(
            f"{latest} has no reference model state (written before references were "
            "checkpointed); resume with a fresh reference by starting a new run"
        )
    await reference.call(partial(load_reference_state, reference, rule, latest)).result()
    log.info("reference model restored from %s", latest)
