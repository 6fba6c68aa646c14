"""RLObjective: what an RL run optimizes, in one frozen record that `run_rl_training` takes.

The loop's other arguments are components (who holds state) and hooks (who is told what
happened); this is the rest: the algorithm or its schedule, the reference policy and how it
follows the policy, the critic, and the pure functions that replace the algorithm's own
(advantages, policy loss, KL). Defaults are the plain algorithm's: its own estimators, a frozen
reference, `compute_policy_loss`, logprobs at temperature 1 recomputed by the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.backend.pytorch import PyTorchTrainingBackend
from training.rl.advantages import AdvantageFn
from training.rl.algorithms import (
    AlgorithmConfig,
    AlgorithmSchedule,
    PolicyLossFn,
    compute_policy_loss,
    constant_schedule,
)
from training.rl.kl import KLFn
from training.rl.preference_loss import PairSelector, best_vs_worst
from training.rl.reference import BaseModelReference, ReferenceUpdateFn, frozen


@dataclass(frozen=True)
class RLObjective:
    """The RL objective's pieces; only `algorithm` has no default.

    Args:
        algorithm: a preset (`grpo()`, `dapo(...)`) for the whole run, or a schedule: (step,
            the previous step's metrics) -> that step's algorithm
            (`training.rl.algorithms.AlgorithmSchedule`, e.g. `switch_at(50, grpo(), dapo())`);
            it is called once per step, right after the previous step is logged. In overlap
            and async modes the rollout side follows a switch from the batch generated after it.
            Required: which algorithm a run trains with is its main decision, never implied.
        temperature: the sampling temperature; trainer logprobs are taken at it too.
        old_from_rollout: use engine logprobs as the behaviour policy (off-policy modes);
            with a mismatch correction (`algorithm.mismatch` or `is_cap`) the ratio is to the
            trainer's logprobs and the engine's weight each token instead (decoupled PPO).
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
        pair_selector: which (chosen, rejected) pairs of a group the pairwise loss (online
            DPO) trains on (`training.rl.preference_loss.PairSelector`); default best vs worst.
            Here rather than in the algorithm config: it is a function, and the config is
            YAML-able data.
    """

    algorithm: AlgorithmConfig | AlgorithmSchedule
    temperature: float = 1.0
    old_from_rollout: bool = False
    reference: PyTorchTrainingBackend | BaseModelReference | None = None
    reference_update: ReferenceUpdateFn = frozen
    critic: PyTorchTrainingBackend | None = None
    advantage_fn: AdvantageFn | None = None
    policy_loss_fn: PolicyLossFn = compute_policy_loss
    kl_fn: KLFn | None = None
    pair_selector: PairSelector = best_vs_worst

    def schedule(self) -> AlgorithmSchedule:
        """The algorithm as a schedule: `algorithm` itself, or a preset used at every step."""
        if isinstance(self.algorithm, AlgorithmConfig):
            return constant_schedule(self.algorithm)
        return self.algorithm

    @property
    def stateful_reference(self) -> PyTorchTrainingBackend | None:
        """The reference when it has weights of its own to checkpoint (not a LoRA base)."""
        if self.reference is None or isinstance(self.reference, BaseModelReference):
            return None
        return self.reference
