"""One RL training step on a rollout batch: advantages → logprobs it needs → optimizer update(s).

`train_on_batch` is what `run_rl_training` calls once per batch. With `mini_batches` = k and
`epochs` = e it makes k·e optimizer steps on the batch (PPO's inner loop): the batch is cut into
k mini-batches of whole groups, visited e times in order, one optimizer step each. The
advantages are computed once for the whole batch, and so are the behaviour-policy logprobs
that the ratio and the importance weights compare against: the engine's in the off-policy
modes, otherwise the trainer's before the first update (one extra forward pass, skipped when
there is a single update, where they equal the current logprobs). The LR schedule and the
weight version advance once per batch, after the last update.

PPO (`algorithm.needs_critic`): the critic's values of the batch give per-token GAE advantages
and returns (training/rl/gae.py), and the critic makes the same k·e updates on the same
mini-batches, queued on its own worker thread so that they run beside the policy's.

Dropout is off in every RL forward pass: the old-policy and reference logprobs come from eval
mode, and the updates run with `forward_backward(dropout=False)`, so all three are the same
function of the weights and the first update's ratio is exactly 1 (with LoRA dropout 0.3 and
two mini-batches it was e^0.081 before). TRL's RL trainers do the same
(`disable_dropout_in_model`); SFT keeps dropout as configured.

Departures: mini-batches are visited in batch order, not reshuffled per epoch (verl shuffles
when asked; the groups of a batch are already in random prompt order).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from rollouts.types import RolloutBatch
from training.backend.pytorch import PyTorchTrainingBackend, merge_metrics
from training.rl.advantages import AdvantageFn
from training.rl.algorithms import AlgorithmConfig, PolicyLossFn, compute_policy_loss
from training.rl.batch import (
    RLExample,
    build_examples,
    kl_penalised_batch,
    sample_to_example,
    split_mini_batches,
    with_old_logprobs,
    with_ref_logprobs,
)
from training.rl.critic import value_loss_fn
from training.rl.distill import teacher_kl_metrics
from training.rl.gae import explained_variance, gae, whiten
from training.rl.kl import KLFn
from training.rl.microbatch_loss import loss_weight_fn, rl_loss_fn, trained_tokens
from training.rl.preference_loss import PairSelector, best_vs_worst


async def train_on_batch(backend: PyTorchTrainingBackend, batch: RolloutBatch,
                         algorithm: AlgorithmConfig, *, temperature: float,
                         old_from_rollout: bool, reference: PyTorchTrainingBackend | None,
                         advantage_fn: AdvantageFn | None = None,
                         policy_loss_fn: PolicyLossFn = compute_policy_loss,
                         kl_fn: KLFn | None = None, share_prompts: bool = True,
                         mini_batches: int = 1, epochs: int = 1,
                         critic: PyTorchTrainingBackend | None = None,
                         pair_selector: PairSelector = best_vs_worst) -> dict[str, float]:  # fmt: skip
    """(KL reward penalty) → advantages → (reference / old logprobs) → k·e optimizer steps.

    `advantage_fn`, `policy_loss_fn` and `kl_fn` replace the algorithm's advantage estimator,
    `compute_policy_loss` and its KL estimator (see `run_rl_training`); `share_prompts` scores
    a group's samples against one copy of their prompt (policy and reference alike). `critic`
    is the value model PPO needs (training/rl/critic.py); its metrics are prefixed "critic_".
    `pair_selector` picks the online-DPO pairs of each group (training/rl/preference_loss.py).

    Returns:
        The step's metrics: each update's loss metrics averaged over the updates (`_max` /
        `_min` keys: the extreme), grad_norm averaged, lr and step of the last update,
        "n_updates" and "kl_to_old_last" (how far the last update had moved from the
        behaviour policy).
    """
    if not batch.groups:
        raise ValueError(
            "train_on_batch: the rollout batch has no groups (every sample failed or every "
            f"group was filtered; sample errors: {dict(batch.failures) or 'none'})"
        )
    if algorithm.needs_ref_logprobs and reference is None:
        raise ValueError(f"{algorithm.name} needs a reference model (kl_coef > 0 or DPO)")
    if algorithm.needs_critic and critic is None:
        raise ValueError(f"{algorithm.name} (advantage=gae) needs a critic (training.rl.critic)")
    metrics: dict[str, float] = {}
    if algorithm.kl_as_reward and algorithm.kl_coef > 0:
        batch, metrics = await _penalise_kl_in_rewards(backend, reference, batch, algorithm, kl_fn,
                                                       share_prompts, temperature)  # fmt: skip
    examples = build_examples(batch, algorithm, advantage_fn, share_prompts=share_prompts,
                              pair_selector=pair_selector)  # fmt: skip
    if algorithm.needs_teacher:  # how far the student is from the teacher, on its own samples
        metrics |= teacher_kl_metrics(batch.samples)
    if not examples:
        return {**metrics, "skipped_empty_batch": 1.0}
    if algorithm.needs_ref_in_loss:
        ref_fut = reference.compute_logprobs(examples, temperature=temperature)
        examples = with_ref_logprobs(examples, await ref_fut.result())
    if algorithm.needs_critic:
        values_S = await critic.compute_values(examples).result()
        examples, gae_metrics = with_gae(examples, values_S, algorithm)
        metrics |= gae_metrics
    # the policy moves between updates: the ratio's behaviour policy is the trainer's before
    # the first (with old_from_rollout, only under a mismatch correction: else the engine's)
    corrected = algorithm.mismatch_correction is not None
    if mini_batches * epochs > 1 and (not old_from_rollout or corrected):
        old_fut = backend.compute_logprobs(examples, temperature=temperature)
        examples = with_old_logprobs(examples, await old_fut.result())
    chunks = split_mini_batches(examples, mini_batches)
    n_updates = len(chunks) * epochs
    loss_fn = rl_loss_fn(algorithm, temperature=temperature, old_from_rollout=old_from_rollout,
                         policy_loss_fn=policy_loss_fn, kl_fn=kl_fn)  # fmt: skip
    critic_futures = []
    if algorithm.needs_critic:  # queued first: the critic's thread works beside the policy's
        value_loss = value_loss_fn(algorithm.value_clip)
        critic_futures = _queue_updates(critic, chunks, n_updates, value_loss,
                                        trained_tokens)  # fmt: skip
    futures = _queue_updates(backend, chunks, n_updates, loss_fn, loss_weight_fn(algorithm))
    updates = [{**await fb.result(), **await opt.result()} for fb, opt in futures]
    metrics |= _merge_updates(updates)
    if critic_futures:
        critic_updates = [{**await fb.result(), **await opt.result()} for fb, opt in critic_futures]
        metrics |= {f"critic_{k}": v for k, v in _merge_updates(critic_updates).items()}
    return metrics


def _queue_updates(backend: PyTorchTrainingBackend, chunks: list[list[RLExample]],
                   n_updates: int, loss_fn, weight_fn) -> list:  # fmt: skip
    """Queue n_updates forward_backward + optim_step pairs over `chunks` (all at once: the
    worker runs them back to back); the last one finishes the training step."""
    futures = []
    for k in range(n_updates):
        fb = backend.forward_backward(chunks[k % len(chunks)], loss_fn=loss_fn,
                                      loss_weight_fn=weight_fn, dropout=False)  # fmt: skip
        futures.append((fb, backend.optim_step(finish_step=k == n_updates - 1)))
    return futures


def with_gae(examples: list[RLExample], values_S: list[torch.Tensor],
             algorithm: AlgorithmConfig) -> tuple[list[RLExample], dict[str, float]]:  # fmt: skip
    """Examples with per-token GAE advantages (whitened over the batch), returns and the
    critic's values attached; metrics of the critic's fit before this step's update."""
    advantages_S, returns_S = [], []
    for example, values_T in zip(examples, values_S, strict=True):
        adv_T, ret_T = gae(example.reward, values_T, gamma=algorithm.gae_gamma,
                           lam=algorithm.gae_lambda)  # fmt: skip
        advantages_S.append(adv_T)
        returns_S.append(ret_T)
    whitened_S = whiten(advantages_S)
    examples = [
        replace(e, token_advantages=tuple(a.tolist()), returns=tuple(r.tolist()),
                old_values=tuple(v.tolist()))
        for e, a, r, v in zip(examples, whitened_S, returns_S, values_S, strict=True)
    ]  # fmt: skip
    values, returns = torch.cat(values_S), torch.cat(returns_S)
    return examples, {
        "value_mean_before": values.mean().item(),
        "returns_mean": returns.mean().item(),
        "explained_variance": explained_variance(values, returns),
    }


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
