"""Reference update rules: each sees the step's metrics; the KL-triggered reset copies the policy
exactly when the accumulated (or one step's) KL passes its budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollouts.errors import ConfigError
from training.backend.state import lerp_params
from training.rl.reference import ema_update, frozen, kl_triggered_reset, periodic_reset


class Weights(SimpleNamespace):
    """Stand-in for a backend: rules change weights only through these two methods, which
    the backend implements with the same `lerp_params` (on each rank's shards)."""

    def copy_weights_from(self, other: Weights) -> None:
        lerp_params(self.model, other.model, 1.0)

    def lerp_weights_from(self, other: Weights, weight: float) -> None:
        lerp_params(self.model, other.model, weight)


def models():
    torch.manual_seed(0)
    return Weights(model=torch.nn.Linear(3, 2)), Weights(model=torch.nn.Linear(3, 2))


def same(a, b) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True)
    )


def test_frozen_and_ema_keep_their_behaviour_under_the_metrics_signature():
    ref, policy = models()
    before = [p.clone() for p in ref.model.parameters()]
    assert frozen(ref, policy, 1, {"kl": 5.0}) is None
    assert all(torch.equal(a, b) for a, b in zip(before, ref.model.parameters(), strict=True))
    ema_update(0.75)(ref, policy, 1, {})
    for old, new, p in zip(before, ref.model.parameters(), policy.model.parameters(), strict=True):
        assert torch.allclose(new, 0.75 * old + 0.25 * p)


def test_periodic_reset_reports_when_it_resets():
    ref, policy = models()
    update = periodic_reset(2)
    assert update(ref, policy, 1, {}) == {"reference_reset": 0.0} and not same(ref, policy)
    assert update(ref, policy, 2, {}) == {"reference_reset": 1.0} and same(ref, policy)


def test_kl_triggered_reset_fires_once_the_accumulated_kl_exceeds_the_budget():
    ref, policy = models()
    update = kl_triggered_reset(1.0)
    out = [update(ref, policy, step, {"kl": kl}) for step, kl in enumerate([0.4, 0.5], 1)]
    assert [o["reference_reset"] for o in out] == [0.0, 0.0] and not same(ref, policy)
    assert out[-1]["reference_kl_accumulated"] == pytest.approx(0.9)
    fired = update(ref, policy, 3, {"kl": 0.2})  # 1.1 > 1.0
    assert fired == pytest.approx({"reference_reset": 1.0, "reference_kl_accumulated": 1.1})
    assert same(ref, policy)
    # the sum restarts after a reset
    assert update(ref, policy, 4, {"kl": 0.3})["reference_kl_accumulated"] == pytest.approx(0.3)


def test_kl_triggered_reset_per_step_mode_ignores_slow_drift():
    ref, policy = models()
    update = kl_triggered_reset(1.0, mode="step")
    for step in range(1, 6):
        assert update(ref, policy, step, {"kl": 0.5})["reference_reset"] == 0.0
    assert update(ref, policy, 6, {"kl": 1.5})["reference_reset"] == 1.0 and same(ref, policy)


def test_kl_triggered_reset_needs_the_kl_to_be_measured():
    ref, policy = models()
    update = kl_triggered_reset(1.0, key="kl")
    assert update(ref, policy, 1, {"skipped_empty_batch": 1.0})["reference_reset"] == 0.0
    with pytest.raises(ConfigError, match="kl_coef > 0"):
        update(ref, policy, 2, {"loss": 0.1})
    with pytest.raises(ConfigError, match="max_kl"):
        kl_triggered_reset(0.0)
