"""Reference policy for KL and preference losses: a frozen copy of the policy, updated by rule.

The reference is a second `PyTorchTrainingBackend` over a deep copy of the policy model whose
optimizer is never stepped; it only answers `compute_logprobs` for the *same sampled tokens*
the policy trains on (never a second generation).

Update rules are the extension point `ReferenceUpdateFn`: `(reference, policy, step, metrics)`
→ extra metrics (or None), called after each optimizer step with that step's metrics (so a
rule can read the measured "kl"), on the reference's worker thread. Shipped: keep frozen, EMA
toward the policy, periodic hard reset, and a hard reset once the KL since the last reset
exceeds a budget.

Under LoRA (`model.lora`) the reference is `BaseModelReference`: the policy's own model with
its adapters off, as TRL and tinker do; no second copy in memory, nothing to checkpoint, and
only the `frozen` rule applies (the base never changes; `check_reference_rule` refuses others).

Checkpoints: `reference_state` (the reference's weights, and the rule's own state when the
rule has `state_dict`, like `kl_triggered_reset`'s KL accumulator) goes into every RL
checkpoint, and `load_reference_state` restores it on resume, so an EMA or reset reference
continues where it was instead of restarting from the initial policy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeAlias

from plumbing.errors import ConfigError
from training.backend.pytorch import PyTorchTrainingBackend

ReferenceUpdateFn: TypeAlias = Callable[
    [PyTorchTrainingBackend, PyTorchTrainingBackend, int, Mapping[str, Any]],
    Mapping[str, float] | None,
]


class BaseModelReference:
    """A LoRA policy's reference: its base model, i.e. the policy with the adapters off.

    Answers `compute_logprobs` on the policy's own worker, in queue order with its training
    operations, so it sees the same (never changing) base weights at every step.
    """

    def __init__(self, policy: PyTorchTrainingBackend):
        if policy.lora is None:
            raise ValueError("BaseModelReference needs a LoRA policy (model.lora set)")
        self.policy = policy

    def compute_logprobs(self, samples: Any, *, temperature: float = 1.0) -> Any:
        return self.policy.compute_logprobs(samples, temperature=temperature, base_model=True)

    def call(self, fn: Callable[[], Any]) -> Any:
        return self.policy.call(fn)

    def close(self) -> None:
        """Nothing to release: the model is the policy's."""


def make_reference(policy: PyTorchTrainingBackend) -> PyTorchTrainingBackend | BaseModelReference:
    """The reference policy: a frozen copy of `policy`'s current model, with the same batching
    (sharded alike under torchrun: every rank copies its own shards); for a LoRA policy its
    base model (`BaseModelReference`), with no copy."""
    if policy.lora is not None:
        return BaseModelReference(policy)
    return PyTorchTrainingBackend(
        None, policy.tokenizer, optim=policy.optim_config, max_steps=1,
        checkpoint_dir=policy.checkpoint_dir / "reference", collate_fn=policy.collate_fn,
        micro_batch_tokens=policy.micro_batch_tokens, pack_length=policy.pack_length,
        frozen=True, weights_from=policy,
    )  # fmt: skip


def check_reference_rule(reference: Any, rule: ReferenceUpdateFn) -> None:
    """Refuse an update rule the reference cannot follow (before any rollout is made).

    Raises:
        ConfigError: a LoRA policy's reference (its base model) with a rule other than `frozen`.
    """
    if isinstance(reference, BaseModelReference):
        check_lora_reference_rule(rule)


def check_lora_reference_rule(rule: ReferenceUpdateFn) -> None:
    """Raise ConfigError unless `rule` is `frozen`, the one rule a LoRA policy's reference
    (its never-changing base model) can follow."""
    if rule is not frozen:
        name = getattr(rule, "__qualname__", type(rule).__name__)
        raise ConfigError(
            f"reference_update={name}: with model.lora the reference is the policy's base "
            "model (adapters off), which never changes, so only the `frozen` rule applies; "
            "train without model.lora to use an EMA or reset reference"
        )


def reference_state(reference: PyTorchTrainingBackend, rule: ReferenceUpdateFn) -> dict[str, Any]:
    """What a checkpoint keeps of the reference: weights (copied) and the rule's state.

    Call on the reference's worker (`reference.call`), after the step's update.
    """
    weights = reference.full_state()
    rule_state = rule.state_dict() if hasattr(rule, "state_dict") else {}
    return {"weights": weights, "rule": rule_state}


def load_reference_state(reference: PyTorchTrainingBackend, rule: ReferenceUpdateFn,
                         checkpoint: Path) -> None:  # fmt: skip
    """Inverse of `reference_state`, from the checkpoint it was saved in (on the reference's
    worker; under torchrun every rank reads its weights from the file)."""
    reference.load_weights_from_checkpoint(checkpoint, "reference")
    if hasattr(rule, "load_state_dict"):
        rule.load_state_dict(reference.read_extra_tensors(checkpoint)["reference"]["rule"])


def reset_to_policy(reference: PyTorchTrainingBackend, policy: PyTorchTrainingBackend) -> None:
    """ref ← policy (copy every weight)."""
    reference.copy_weights_from(policy)


def frozen(
    reference: PyTorchTrainingBackend,
    policy: PyTorchTrainingBackend,
    step: int,
    metrics: Mapping[str, Any],
) -> None:
    """Never update the reference (the classic KL anchor)."""


def ema_update(alpha: float) -> ReferenceUpdateFn:
    """ref ← alpha·ref + (1 − alpha)·policy after every step."""

    def update(
        reference: PyTorchTrainingBackend,
        policy: PyTorchTrainingBackend,
        step: int,
        metrics: Mapping[str, Any],
    ) -> None:
        reference.lerp_weights_from(policy, 1 - alpha)

    return update


def periodic_reset(every: int) -> ReferenceUpdateFn:
    """ref ← policy every `every` steps (hard reset); logs "reference_reset" (0 or 1)."""

    def update(
        reference: PyTorchTrainingBackend,
        policy: PyTorchTrainingBackend,
        step: int,
        metrics: Mapping[str, Any],
    ) -> dict[str, float]:
        reset = step % every == 0
        if reset:
            reset_to_policy(reference, policy)
        return {"reference_reset": float(reset)}

    return update


def kl_triggered_reset(
    max_kl: float, *, key: str = "kl", mode: Literal["accumulated", "step"] = "accumulated"
) -> ReferenceUpdateFn:
    """ref ← policy once the measured KL to the reference exceeds `max_kl`.

    `mode="accumulated"` sums each step's `metrics[key]` (mean per-token KL) since the last
    reset and resets when the sum exceeds `max_kl`, so a slow steady drift also triggers it;
    `mode="step"` resets when a single step's KL exceeds it. Logs "reference_reset" (0 or 1)
    and "reference_kl_accumulated" (the sum since the last reset, before this one).

    The KL must be measured: use an algorithm with kl_coef > 0 (KL loss or KL reward).
    A step that trained on nothing ("skipped_empty_batch") is not counted.

    Raises (when called): ConfigError if `metrics` has no `key` on a step that trained.
    """
    if max_kl <= 0:
        raise ConfigError(f"kl_triggered_reset: max_kl must be > 0, got {max_kl}")
    if mode not in ("accumulated", "step"):
        raise ConfigError(f"kl_triggered_reset: mode {mode!r}; use 'accumulated' or 'step'")
    return _KLTriggeredReset(max_kl, key, mode)


class _KLTriggeredReset:
    """`kl_triggered_reset`'s rule: the KL accumulated since the last reset is its state."""

    def __init__(self, max_kl: float, key: str, mode: str):
        self.max_kl, self.key, self.mode = max_kl, key, mode
        self.accumulated = 0.0  # since the last reset; checkpointed through state_dict

    def state_dict(self) -> dict[str, float]:
        return {"accumulated": self.accumulated}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.accumulated = float(state["accumulated"])

    def __call__(
        self,
        reference: PyTorchTrainingBackend,
        policy: PyTorchTrainingBackend,
        step: int,
        metrics: Mapping[str, Any],
    ) -> dict[str, float]:
        if self.key not in metrics:
            if metrics.get("skipped_empty_batch"):
                return {"reference_reset": 0.0, "reference_kl_accumulated": self.accumulated}
            raise ConfigError(
                f"kl_triggered_reset reads metrics[{self.key!r}], which step {step} did not "
                "log; use an algorithm with kl_coef > 0 so the KL to the reference is measured"
            )
        kl = float(metrics[self.key])
        self.accumulated += kl
        measured = self.accumulated if self.mode == "accumulated" else kl
        out = {"reference_reset": 0.0, "reference_kl_accumulated": self.accumulated}
        if measured > self.max_kl:
            reset_to_policy(reference, policy)
            self.accumulated = 0.0
            out["reference_reset"] = 1.0
        return out
