"""One RL training step on a rollout batch: advantages → logprobs it needs → optimizer update(s).

`train_on_batch` is what `run_rl_training` calls once per batch. With `mini_batches` = k and
`epochs` = e it makes k·e optimizer steps on the batch (PPO's inner loop): the batch is cut into
k mini-batches of whole groups, visited e times in order, one optimizer step each. The
advantages are computed once for the whole batch, and so are the behaviour-policy logprobs
that the ratio and the importance weights compare against: the engine's in the off-policy
modes, otherwise the trainer's before the first update (one extra forward pass, skipped when
there is a single update, where they equal the current logprobs). The LR schedule and the
weight version advance once per batch, after the last update.

Departures: mini-batches are visited in batch order, not reshuffled per epoch (verl shuffles
when asked; the groups of a batch are already in random prompt order).
"""

from __future__ import annotations

from typing import Any

import torch

from rollouts.types import RolloutBatch
from training.advantages import AdvantageFn
from training.algorithms import AlgorithmConfig, PolicyLossFn, compute_policy_loss
from training.backend import PyTorchTrainingBackend, merge_metrics
from training.kl import KLFn
from training.rl_batch import (
    build_examples,
    kl_penalised_batch,
    loss_weight_fn,
    rl_loss_fn,
    sample_to_example,
    split_mini_batches,
    with_old_logprobs,
    with_ref_logprobs,
)


async def train_on_batch(backend: PyTorchTrainingBackend, batch: RolloutBatch,
                         algorithm: AlgorithmConfig, *, temperature: float,
                         old_from_rollout: bool, reference: PyTorchTrainingBackend | None,
                         advantage_fn: AdvantageFn | None = None,
                         policy_loss_fn: PolicyLossFn = compute_policy_loss,
                         kl_fn: KLFn | None = None, share_prompts: bool = True,
                         mini_batches: int = 1, epochs: int = 1) -> dict[str, float]:  # fmt: skip
    """(KL reward penalty) → advantages → (reference / old logprobs) → k·e optimizer steps.

    `advantage_fn`, `policy_loss_fn` and `kl_fn` replace the algorithm's advantage estimator,
    `compute_policy_loss` and its KL estimator (see `run_rl_training`); `share_prompts` scores
    a group's samples against one copy of their prompt (policy and reference alike).

    Returns:
        The step's metrics: each update's loss metrics averaged over the updates (`_max` /
        `_min` keys: the extreme), grad_norm averaged, lr and step of the last update,
        "n_updates" and "kl_to_old_last" (how far the last update had moved from the
        behaviour policy).
    """
    if algorithm.needs_ref_logprobs and reference is None:
        raise ValueError(f"{algorithm.name} needs a reference model (kl_coef > 0 or DPO)")
    metrics: dict[str, float] = {}
    if algorithm.kl_as_reward and algorithm.kl_coef > 0:
        batch, metrics = await _penalise_kl_in_rewards(backend, reference, batch, algorithm, kl_fn,
                                                       share_prompts, temperature)  # fmt: skip
    examples = build_examples(batch, algorithm, advantage_fn, share_prompts=share_prompts)
    if not examples:
        return {**metrics, "skipped_empty_batch": 1.0}
    if algorithm.needs_ref_in_loss:
        ref_fut = reference.compute_logprobs(examples, temperature=temperature)
        examples = with_ref_logprobs(examples, await ref_fut.result())
    chunks = split_mini_batches(examples, mini_batches)
    n_updates = len(chunks) * epochs
    if n_updates > 1 and not old_from_rollout:  # the policy moves between updates
        old_fut = backend.compute_logprobs(examples, temperature=temperature)
        examples = with_old_logprobs(examples, await old_fut.result())
        chunks = split_mini_batches(examples, mini_batches)
    loss_fn = rl_loss_fn(algorithm, temperature=temperature, old_from_rollout=old_from_rollout,
                         policy_loss_fn=policy_loss_fn, kl_fn=kl_fn)  # fmt: skip
    futures = []
    for k in range(n_updates):  # all queued at once: the worker runs them back to back
        fb = backend.forward_backward(chunks[k % len(chunks)], loss_fn=loss_fn,
                                      loss_weight_fn=loss_weight_fn(algorithm))  # fmt: skip
        futures.append((fb, backend.optim_step(finish_step=k == n_updates - 1)))
    updates = [{**await fb.result(), **await opt.result()} for fb, opt in futures]
    return {**metrics, **_merge_updates(updates)}


def _merge_updates(updates: list[dict[str, Any]]) -> dict[str, float]:
    """One step's metrics from its updates' (counts summed, the last update's lr and step)."""
    merged: dict[str, float] = {}
    for update in updates:
        merge_metrics(merged, update, 1.0 / len(updates))
    last = updates[-1]
    for key in ("n_samples", "n_tokens", "n_trained_tokens", "n_microbatches",
                "time_forward_backward_s"):  # fmt: skip
        if key in last:
            merged[key] = float(sum(u[key] for u in updates))
    merged |= {"lr": last["lr"], "step": last["step"], "n_updates": float(len(updates))}
    if "kl_to_old" in last:
        merged["kl_to_old_last"] = last["kl_to_old"]
    return merged


async def _penalise_kl_in_rewards(backend, reference, batch: RolloutBatch, algorithm, kl_fn,
                                  share_prompts: bool, temperature: float
                                  ) -> tuple[RolloutBatch, dict[str, float]]:  # fmt: skip
    """The batch with KL(policy ‖ reference) of its sampled tokens subtracted from rewards.

    Both logprobs are of the tempered distribution the engine sampled from, as in the loss.
    """
    trained = [s for s in batch.samples if s.num_trained_tokens]
    examples = [sample_to_example(s, 0.0, share_prompt=share_prompts) for s in trained]
    policy_fut = backend.compute_logprobs(examples, temperature=temperature)
    ref_fut = reference.compute_logprobs(examples, temperature=temperature)
    policy_lp, ref_lp = iter(await policy_fut.result()), iter(await ref_fut.result())
    logprobs_S: list[torch.Tensor] = []
    ref_logprobs_S: list[torch.Tensor] = []
    for sample in batch.samples:  # samples with no trained token get empty rows
        logprobs_S.append(next(policy_lp) if sample.num_trained_tokens else torch.zeros(0))
        ref_logprobs_S.append(next(ref_lp) if sample.num_trained_tokens else torch.zeros(0))
    return kl_penalised_batch(batch, algorithm, logprobs_S, ref_logprobs_S, kl_fn=kl_fn)
