"""Reward shaping: named terms added to a scored sample's reward, kept as reward components.

A shaping term is a plain `(sample) -> float` (any sync scalar reward works, e.g.
`rollouts.rewards.length_penalty`); `add_shaping(name, term)` turns it into a
`SampleTransform` (`Sample -> Sample`) for `AsyncRolloutManager(transforms=...)`. The term's
value goes into `reward_components[name]` and is added to `reward`, so every shaped part
shows up in the step's `reward/<name>` metrics and the total stays their sum.

Shipped terms: `length_bonus` (per generated token; a negative coefficient penalises) and
`entropy_bonus` (the sampled tokens' mean surprisal under the engine). The KL penalty needs
reference-model logprobs, so it is applied on the trainer side
(`training.rl.batch.kl_penalised_batch`, enabled by `kl_as_reward`).

Transforms run after the group filter: shaping does not decide which groups are kept.
"""

from __future__ import annotations

from collections.abc import Callable

from plumbing.errors import ConfigError, DataError
from rollouts.groups import SampleTransform
from rollouts.types import Sample

ShapingTerm = Callable[[Sample], float]


def add_reward_component(sample: Sample, name: str, value: float) -> Sample:
    """`sample` with `value` added to its reward and recorded as component `name`.

    A sample scored by a scalar reward has no components yet; its reward is kept as "task"
    so the components still add up to the total.

    Raises:
        ValueError: the sample already has a component `name`.
    """
    components = dict(sample.reward_components) or {"task": sample.reward}
    if name in components:
        raise ValueError(f"reward component {name!r} already set on this sample; pick another name")
    return sample.with_reward(sample.reward + value, {**components, name: value})


def add_shaping(name: str, term: ShapingTerm) -> SampleTransform:
    """A transform that adds `term(sample)` to each sample's reward as component `name`."""

    def shape(sample: Sample) -> Sample:
        return add_reward_component(sample, name, float(term(sample)))

    return shape


def length_bonus(coef: float, *, max_tokens: int | None = None) -> ShapingTerm:
    """`coef` × the number of tokens the model generated (loss_mask == 1), capped at `max_tokens`.

    Positive `coef` rewards longer answers, negative penalises every token (for a penalty
    only beyond a budget use `rollouts.rewards.length_penalty`). Tool tokens do not count.
    """
    if max_tokens is not None and max_tokens < 0:
        raise ConfigError(f"length_bonus: max_tokens must be >= 0, got {max_tokens}")

    def length(sample: Sample) -> float:
        n = sample.num_trained_tokens
        return coef * (n if max_tokens is None else min(n, max_tokens))

    return length


def entropy_bonus(coef: float) -> ShapingTerm:
    """`coef` × mean over generated tokens of −log p(token) under the engine's logprobs.

    The sampled tokens' mean surprisal is an unbiased estimate of the policy's per-token
    entropy, so a positive `coef` rewards exploratory samples. 0 for a sample with no
    generated tokens.

    Raises (when applied): DataError if the sample has generated tokens but no engine logprobs.
    """

    def entropy(sample: Sample) -> float:
        n = sample.num_trained_tokens
        if n == 0:
            return 0.0
        if not sample.rollout_logprobs:
            raise DataError(
                f"entropy_bonus: group {sample.group_id} sample {sample.index_in_group} has no "
                "rollout logprobs; request them from the engine (return_logprob=True)"
            )
        pairs = zip(sample.rollout_logprobs, sample.loss_mask, strict=True)
        return coef * -sum(lp for lp, m in pairs if m) / n

    return entropy
