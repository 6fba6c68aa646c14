"""The loops' signatures stay small and their grouped arguments keep the old defaults.

`run_rl_training` once took 24 parameters; it now takes the components, its config, an
`RLObjective` and `RLHooks` (and `run_sft_training` the same shape with `SFTHooks`). These
tests pin the bound a reader can hold in mind and that grouping changed no default.
"""

import dataclasses
import inspect

import pytest

from training import run_rl_training, run_sft_training

MAX_LOOP_PARAMETERS = 12


@pytest.mark.parametrize("loop", [run_rl_training, run_sft_training], ids=lambda f: f.__name__)
def test_each_loop_takes_at_most_twelve_parameters(loop):
    parameters = inspect.signature(loop).parameters
    assert len(parameters) <= MAX_LOOP_PARAMETERS, list(parameters)


def test_the_rl_objective_defaults_are_the_loops_old_defaults():
    from training import RLObjective, compute_policy_loss, frozen, grpo

    algorithm = grpo()
    objective = RLObjective(algorithm)
    assert objective.policy_loss_fn is compute_policy_loss
    assert objective.reference_update is frozen
    assert objective.temperature == 1.0
    assert objective.old_from_rollout is False
    assert objective.reference is None and objective.critic is None
    assert objective.advantage_fn is None and objective.kl_fn is None
    assert objective.schedule()(7, {}) is algorithm  # a preset is used at every step
    with pytest.raises(TypeError):  # which algorithm a run trains with is never implied
        RLObjective()  # type: ignore[call-arg]


def test_hooks_default_to_none_and_no_grouped_argument_can_change_after_construction():
    from training import RLHooks, RLObjective, SFTHooks, grpo

    for hooks in (RLHooks(), SFTHooks()):
        assert all(getattr(hooks, f.name) is None for f in dataclasses.fields(hooks))
    defaults = {n: p.default for n, p in inspect.signature(run_rl_training).parameters.items()}
    assert defaults["hooks"] == RLHooks() and defaults["pause_mode"] == "abort"
    assert inspect.signature(run_sft_training).parameters["hooks"].default == SFTHooks()
    with pytest.raises(dataclasses.FrozenInstanceError):
        RLObjective(grpo()).temperature = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        RLHooks().logger = print  # type: ignore[misc]
