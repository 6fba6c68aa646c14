"""run_rl_training: the RL loop, a pure async function over stateful components.

One step reads top to bottom: batch of groups (AsyncRolloutManager) → algorithm for this step →
`train_on_batch` (advantages, reference and old logprobs of the same tokens if needed, then one
or more forward_backward + optim_step: training/rl/step.py) → every `sync_every` steps export weights and pause every engine; the engines load
the weights in the background (requests sent meanwhile wait and run on the new weights) →
maybe checkpoint → maybe eval → log (the checkpoint first: an evaluation that fails never
costs trained steps). All state lives in the backend (weights, optimizer, versions),
the DataBuffer (cursor + held groups) and the engines; resume loads them.

Cancellation (Ctrl-C, a host app's cancel scope) propagates out of whatever await is running:
the rollout manager aborts its requests, the backend finishes the one queued op, and the last
complete checkpoint stays intact because checkpoints are renamed into place only when whole.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias

import trio

from engines.weight_sync import (
    lora_version_name,
    pause_engines,
    sync_lora_to_engines,
    sync_weights_to_engines,
)
from rollouts.errors import CheckpointError, ConfigError, RolloutsError
from rollouts.generation import summarize_errors
from rollouts.nursery import open_nursery
from rollouts.types import RolloutBatch
from training.backend.checkpoint import checkpoint_name, find_latest_checkpoint
from training.backend.pytorch import PyTorchTrainingBackend
from training.data.buffer import DataBuffer
from training.loops.loggers import Logger
from training.loops.sft import maybe_resume
from training.rl.advantages import AdvantageFn
from training.rl.algorithms import (
    AlgorithmConfig,
    AlgorithmSchedule,
    PolicyLossFn,
    compute_policy_loss,
    constant_schedule,
)
from training.rl.kl import KLFn
from training.rl.reference import (
    BaseModelReference,
    ReferenceUpdateFn,
    check_reference_rule,
    frozen,
    load_reference_state,
    reference_state,
)
from training.rl.signal import NoSignalWatch
from training.rl.step import train_on_batch as train_on_batch
from training.rl_config import RLLoopConfig

log = logging.getLogger("rollouts.rl")

EvaluateFn: TypeAlias = Callable[[], Awaitable[dict[str, float]]]
StopFn: TypeAlias = Callable[[int, Mapping[str, Any]], bool]
"""(step, that step's metrics) -> True to stop after this step (its checkpoint is written)."""
CheckpointHook: TypeAlias = Callable[[int, Path, Mapping[str, Any]], None]
"""(step, checkpoint directory, that step's metrics), called after each checkpoint is written."""


async def push_weights(backend: PyTorchTrainingBackend, engines: Sequence[Any], export_root: Path,
                       *, pause_mode: str = "abort", keep: int = 2) -> float:  # fmt: skip
    """Export the current weights (HF layout) and load them into every engine; with LoRA
    (`backend.lora`) export only the adapter and load it as `<name>-v<version>` (see
    `start_push`).

    Returns:
        Seconds for export + sync.
    """
    t0 = time.perf_counter()
    async with open_nursery() as nursery:  # `start_push`, waiting for its background part
        await start_push(backend, engines, export_root, nursery, pause_mode=pause_mode, keep=keep)
    return time.perf_counter() - t0


@dataclass
class PendingPush:
    """A weight push whose engines are paused and whose load finishes in the background."""

    done: trio.Event = field(default_factory=trio.Event)
    engines_s: float | None = None  # update + verify + resume, once done


async def start_push(backend: PyTorchTrainingBackend, engines: Sequence[Any], export_root: Path,
                     nursery: trio.Nursery, *, pause_mode: str = "abort",
                     keep: int = 2) -> PendingPush:  # fmt: skip
    """`push_weights` with the engines' part in `nursery`: returns once every engine is paused.

    From then on any request sent to the engines (the next batch, an evaluation) waits in them
    and runs on the new weights, so the order of the loop is kept, while the trainer goes on
    with its next step instead of waiting for the engines to load (update, verify and resume:
    ~10 ms a step over loopback for the tiny model, more for real ones). A failure raises
    `WeightSyncError` in `nursery`.

    With LoRA the export is the adapter alone (peft's layout) and each engine loads it with
    `/load_lora_adapter` as `<lora.name>-v<version>`, makes it the adapter its generation
    requests name, and unloads the versions beyond the newest `lora.keep`; the weight version
    label moves as for full weights, so staleness accounting is the same.
    """
    version = backend.weight_version
    path = await backend.export_weights(export_root / f"v{version:06d}")
    lora = backend.lora
    name = None if lora is None else lora_version_name(lora.name, version)
    # With LoRA the paused engines name the new adapter at once: requests sent before the
    # background sync loads it (the next batch) wait for it and run on it, as for full weights.
    await pause_engines(engines, pause_mode, activate_lora=name)
    pending = PendingPush()

    async def finish() -> None:
        t0 = time.perf_counter()
        try:
            if lora is None or name is None:
                await sync_weights_to_engines(engines, path, str(version), pause_mode=pause_mode,
                                              paused=True)  # fmt: skip
            else:
                await sync_lora_to_engines(engines, path, name, str(version), keep=lora.keep,
                                           pause_mode=pause_mode, paused=True)  # fmt: skip
            # An adapter still loaded may be reloaded from its path (SGLang does so for a name
            # unloaded and asked for again): keep the exports of every loaded version.
            _prune_exports(export_root, keep if lora is None else max(keep, lora.keep + 1))
        finally:
            pending.engines_s = time.perf_counter() - t0
            pending.done.set()

    nursery.start_soon(finish)
    return pending


def _prune_exports(export_root: Path, keep: int) -> None:
    for old in sorted(export_root.glob("v*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


async def run_rl_training(
    backend: PyTorchTrainingBackend,
    data_buffer: DataBuffer,
    rollout_manager: Any,
    engines: Sequence[Any],
    config: RLLoopConfig,
    *,
    algorithm: AlgorithmConfig | AlgorithmSchedule,
    export_dir: str | Path,
    temperature: float = 1.0,
    old_from_rollout: bool = False,
    reference: PyTorchTrainingBackend | BaseModelReference | None = None,
    reference_update: ReferenceUpdateFn = frozen,
    critic: PyTorchTrainingBackend | None = None,
    advantage_fn: AdvantageFn | None = None,
    policy_loss_fn: PolicyLossFn = compute_policy_loss,
    kl_fn: KLFn | None = None,
    logger: Logger = lambda step, metrics: None,
    stop_fn: StopFn | None = None,
    checkpoint_hook: CheckpointHook | None = None,
    evaluate_fn: EvaluateFn | None = None,
    pause_mode: str = "abort",
    share_prompts: bool = True,
    resolved_config: dict[str, Any] | None = None,
    on_batch: Callable[[int, RolloutBatch], None] | None = None,
    on_algorithm_switch: Callable[[AlgorithmConfig], None] | None = None,
) -> list[dict[str, Any]]:
    """Train with RL until `config.max_steps` optimizer steps are done (or `stop_fn` says stop).

    The reward is the rollout manager's (`AsyncRolloutManager(reward_fn=..., transforms=...)`);
    every other extension point is an argument here.

    Args:
        backend: the policy being trained; its checkpoint_dir is where resume looks.
        data_buffer: the prompts (the rollout manager draws from it); checkpointed with held groups.
        rollout_manager: has `async generate_batch() -> RolloutBatch`; its `async settle()`, if
            it has one, is awaited before each weight push (see `AsyncRolloutManager.settle`),
            and its `use_algorithm(algorithm)`, if it has one, is called before the first batch
            and whenever the algorithm changes (reward shaping and group filtering follow the
            algorithm: `dapo()` gets its overlong penalty and dynamic sampling).
        engines: every engine that serves the policy; all receive each weight update.
        algorithm: a preset (`grpo()`, `dapo(...)`) for the whole run, or a schedule: (step,
            the previous step's metrics) -> that step's algorithm
            (`training.rl.algorithms.AlgorithmSchedule`, e.g. `switch_at(50, grpo(), dapo())`);
            it is called once per step, right after the previous step is logged. In overlap
            and async modes the rollout side follows a switch from the batch generated after it.
        export_dir: where exported weights go for the engines to load (same filesystem).
        old_from_rollout: use engine logprobs as the behaviour policy (off-policy modes).
        reference: frozen reference policy for KL / DPO (needed only if the algorithm says so);
            `make_reference(backend)` builds the right one (a LoRA policy's is its base model).
        reference_update: how the reference follows the policy (frozen, EMA, periodic or
            KL-triggered reset); sees each step's metrics, its own are merged into them.
        critic: PPO's value model (`training.rl.critic.make_critic`), trained beside the policy
            and checkpointed with it (its checkpoint is written first, so a policy checkpoint
            always has its critic's); needed only by algorithms with advantage="gae".
        advantage_fn: rewards [G, N] → advantages [G, N]; None: the algorithm's estimator.
        policy_loss_fn: replaces `compute_policy_loss` (same signature; may wrap it).
        kl_fn: per-token KL (`training.rl.kl.KLFn`) for the KL loss term and the KL reward
            penalty; None: the algorithm's `kl_kind` estimator.
        logger: called with (step, metrics) after every step.
        stop_fn: called with (step, metrics) after logging; True ends the run after this
            step's checkpoint.
        checkpoint_hook: called with (step, checkpoint path, metrics) after each checkpoint.
        evaluate_fn: held-out evaluation through the engines, every `eval_every` steps.
        share_prompts: score each group's samples against one shared copy of their prompt
            (training/data/prefix_sharing.py: same logprobs and gradients, ~3x less compute on
            short responses); False: one model row per sample. Needs sdpa or eager attention.
        on_batch: called with each rollout batch (e.g. `training.rl.rollout_dump.RolloutDumpWriter`).
        on_algorithm_switch: called with the next step's algorithm when it differs from this
            step's (after the rollout manager's `use_algorithm`).

    Returns:
        The metrics of each step this call ran.
    """
    algorithm = as_schedule(algorithm)
    check_rl_backend(backend)
    check_reference_rule(reference, reference_update)
    export_root = Path(export_dir)
    start = await maybe_resume(backend, data_buffer, config)
    stateful_reference = reference is not None and not isinstance(reference, BaseModelReference)
    if start > 0 and stateful_reference:  # the reference continues where it was too
        await _restore_reference(backend, reference, reference_update)
    if start > 0 and critic is not None:
        await critic.load_checkpoint(critic.checkpoint_dir / checkpoint_name(start))
    if start > 0:  # the engines must serve the resumed weights, not the initial ones
        await push_weights(backend, engines, export_root, pause_mode=pause_mode)
    history: list[dict[str, Any]] = []
    empty_total = 0
    signal = NoSignalWatch(config.no_signal_steps)  # one warning when groups stop differing
    use_algorithm = getattr(rollout_manager, "use_algorithm", None)
    algo = algorithm(start + 1, {})
    if use_algorithm is not None:
        use_algorithm(algo)

    async def save(step: int, metrics: dict[str, Any]) -> None:
        if critic is not None:  # first: `latest` of the policy implies its critic's
            await critic.save_checkpoint(step, metrics)
        await _checkpoint(backend, step, metrics, data_buffer, resolved_config, checkpoint_hook,
                          reference, reference_update)  # fmt: skip

    async with open_nursery() as pushes:  # waits for the last push before returning
        pending: PendingPush | None = None
        settle = getattr(rollout_manager, "settle", None)
        for step in range(start + 1, config.max_steps + 1):
            t0 = time.perf_counter()
            batch, skipped = await _generate_nonempty(rollout_manager, step,
                                                      config.max_empty_batches)  # fmt: skip
            empty_total += skipped
            t_generated = time.perf_counter()
            if on_batch is not None:
                on_batch(step, batch)
            metrics: dict[str, Any] = dict(batch.metrics) | signal.observe(step, batch)
            metrics |= await train_on_batch(backend, batch, algo, temperature=temperature,
                                            old_from_rollout=old_from_rollout,
                                            reference=reference, advantage_fn=advantage_fn,
                                            policy_loss_fn=policy_loss_fn, kl_fn=kl_fn,
                                            share_prompts=share_prompts,
                                            mini_batches=config.mini_batches,
                                            epochs=config.epochs, critic=critic)  # fmt: skip
            if reference is not None:
                update = partial(reference_update, reference, backend, step, dict(metrics))
                metrics |= await reference.call(update).result() or {}
            t_trained = time.perf_counter()
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
                                           pause_mode=pause_mode)  # fmt: skip
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
            # The checkpoint comes before the evaluation: a failing evaluation (or a crash in
            # it) never costs the steps trained since the last one. It has no eval_* metrics.
            saved = step % config.checkpoint_every == 0 or step == config.max_steps
            try:
                if saved:
                    await save(step, metrics)
                if evaluate_fn is not None and (
                    step % config.eval_every == 0 or step == config.max_steps
                ):
                    metrics |= {f"eval_{k}": v for k, v in (await evaluate_fn()).items()}
            finally:
                # Even when cancelled here (Ctrl-C during the evaluation, or just as the save
                # ended): a step whose checkpoint exists must have its row, since a resume
                # from it logs only later steps. A row without a checkpoint is harmless: the
                # resume replaces rows after its own checkpoint.
                logger(step, metrics)
            history.append(metrics)
            upcoming = algorithm(step + 1, metrics)
            if upcoming != algo and step < config.max_steps:
                log.info("algorithm from step %d: %s", step + 1, upcoming.name)
                if use_algorithm is not None:
                    use_algorithm(upcoming)
                if on_algorithm_switch is not None:
                    on_algorithm_switch(upcoming)
            algo = upcoming
            stop = stop_fn is not None and stop_fn(step, metrics)
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


def _why_empty(batch: RolloutBatch) -> str:
    m = batch.metrics
    counts = (f"no group accepted of {m.get('groups_launched', 0):.0f} launched "
              f"({m.get('groups_failed', 0):.0f} with failed samples, "
              f"{m.get('groups_filtered', 0):.0f} filtered out for equal rewards)")  # fmt: skip
    if batch.failures:
        return f"{counts}; sample errors: {summarize_errors(batch.failures)}"
    return counts


def as_schedule(algorithm: AlgorithmConfig | AlgorithmSchedule) -> AlgorithmSchedule:
    """A schedule: `algorithm` itself, or a preset used at every step."""
    if isinstance(algorithm, AlgorithmConfig):
        return constant_schedule(algorithm)
    return algorithm


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
                      data_buffer: DataBuffer, resolved_config: dict[str, Any] | None,
                      hook: CheckpointHook | None, reference: PyTorchTrainingBackend | None,
                      reference_update: ReferenceUpdateFn) -> None:  # fmt: skip
    extra = {"data_buffer": data_buffer.state_dict(), "config": resolved_config or {}}
    tensors = {}
    if reference is not None and not isinstance(reference, BaseModelReference):
        state = partial(reference_state, reference, reference_update)
        tensors["reference"] = await reference.call(state).result()
    path = await backend.save_checkpoint(step, metrics, extra_state=extra, extra_tensors=tensors)
    if hook is not None:
        hook(step, path, metrics)


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
