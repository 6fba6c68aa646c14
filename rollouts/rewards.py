"""Reward functions: pure builders (exact match, format, length, vector rewards, aggregators).

A reward is a plain callable `(sample) -> float`, or `(sample) -> Mapping[str, float]` for a
vector reward, and may be `async def`. Convention for vector rewards: the mapping holds the
named components plus the aggregated scalar under the key "total" (`TOTAL`);
`rollouts.scoring.score_sample` turns it into `sample.with_reward(total, components)`. A
mapping without "total" is an error, so an aggregate is never guessed.

The builders are pure: they only read the sample. Running one (`call_reward`: sync rewards in
a worker thread so a slow verifier never blocks the event loop, async rewards awaited) and
checking its value are in `rollouts.reward_calls`, with the reward types; all of those names
stay importable from here. Scoring a sample under a timeout (`score_sample`) and the samples
of one finished request together (`score_samples`) live in `rollouts.scoring`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from plumbing.errors import ConfigError, DataError
from rollouts.reward_calls import TOTAL as TOTAL
from rollouts.reward_calls import Aggregator as Aggregator
from rollouts.reward_calls import RewardFn as RewardFn
from rollouts.reward_calls import RewardValue as RewardValue
from rollouts.reward_calls import call_reward as call_reward
from rollouts.reward_calls import is_async_reward as is_async_reward
from rollouts.reward_calls import reward_name as reward_name
from rollouts.reward_calls import scalar_reward as scalar_reward
from rollouts.reward_calls import split_reward as split_reward
from rollouts.types import Sample

_INT_RE = re.compile(r"[-+]?\d+")


# ----- answer extraction and exact match -------------------------------------------------------


def last_integer(text: str) -> str | None:
    """The last integer in `text` (e.g. "so the answer is 46." → "46"), or None."""
    matches = _INT_RE.findall(text.replace(",", ""))
    return matches[-1] if matches else None


def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def normalize_answer(answer: str) -> str:
    """Strip whitespace and a trailing period; integers compare by value ("+046" == "46")."""
    answer = answer.strip().rstrip(".").strip()
    try:
        return str(int(answer.replace(",", "")))
    except ValueError:
        return answer


def exact_match_reward(
    extract: Callable[[str], str | None] = last_integer,
    *,
    key: str = "answer",
    normalize: Callable[[str], str] = normalize_answer,
) -> Callable[[Sample], float]:
    """A reward of 1.0 when the extracted answer equals `sample.metadata[key]`, else 0.0.

    Args:
        extract: pulls the final answer out of `sample.response_text` (None: no answer, 0.0).
        key: metadata field holding the ground truth (converted with `str`).
        normalize: applied to both sides before comparing.

    Returns:
        A sync RewardFn. It raises `DataError` when the sample has no `key` in its metadata,
        which `score_sample` turns into a failed sample (or a RewardError under fail-fast).
    """

    def exact_match(sample: Sample) -> float:
        if key not in sample.metadata:
            raise DataError(
                f"exact_match_reward: sample metadata has no {key!r} "
                f"(keys: {sorted(sample.metadata)}); add the ground truth to the prompt record"
            )
        predicted = extract(sample.response_text)
        if predicted is None:
            return 0.0
        return float(normalize(predicted) == normalize(str(sample.metadata[key])))

    return exact_match


# ----- format and length shaping ---------------------------------------------------------------


def regex_format_reward(
    pattern: str | re.Pattern[str], *, reward: float = 1.0, penalty: float = 0.0, flags: int = 0
) -> Callable[[Sample], float]:
    """`reward` when `pattern` is found in the response text (`re.search`), else `penalty`.

    Anchor the pattern (`^...$`, with `flags=re.DOTALL`) to require the whole response to
    have the format, e.g. r"^<think>.*</think>\\s*<answer>.*</answer>$".
    """
    compiled = re.compile(pattern, flags)

    def regex_format(sample: Sample) -> float:
        return reward if compiled.search(sample.response_text) else penalty

    return regex_format


def length_penalty(max_tokens: int, coef: float) -> Callable[[Sample], float]:
    """`-coef` per model token beyond `max_tokens` (0 within budget).

    Counts the tokens the model generated (loss_mask == 1), so tool output does not count
    against the policy.
    """
    if max_tokens < 0 or coef < 0:
        raise ConfigError(
            f"length_penalty: need max_tokens >= 0 and coef >= 0, got {max_tokens}, {coef}"
        )

    def length(sample: Sample) -> float:
        return -coef * max(0, sample.num_trained_tokens - max_tokens)

    return length


def overlong_penalty(
    max_response_len: int, cache_len: int, penalty_factor: float = 1.0
) -> Callable[[Sample], float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty_factor`.

    L is the number of tokens the model sampled (`num_trained_tokens`; tool and environment
    tokens of a multi-turn episode are not counted) and `max_response_len` is the generation
    budget of the whole episode: `max_new_tokens` for one turn, the episode's
    `max_response_tokens` for multi-turn. The penalty is 0 while L <= max_response_len -
    cache_len, then linear down to -penalty_factor at L = max_response_len, and
    -penalty_factor beyond. Add it to the task reward (see `add_overlong_shaping`).
    cache_len = 0 gives a hard step at the limit.

    A truncated sample (cut by a length limit, the episode's token budget or `max_turns`)
    gets -penalty_factor whatever its L, as DAPO's response cut at its budget does: in a tool
    episode the budget counts the tool results too, so the model's own tokens never reach it
    and the ramp alone would give an episode cut at the budget 0.

    Raises:
        ConfigError: cache_len is outside [0, max_response_len].
    """
    if not 0 <= cache_len <= max_response_len:
        raise ConfigError(
            f"overlong_penalty: cache_len={cache_len} must be in [0, max_response_len={max_response_len}]"
        )
    soft_start = max_response_len - cache_len

    def overlong(sample: Sample) -> float:
        n = sample.num_trained_tokens
        if sample.status == "truncated" or n > max_response_len:
            return -penalty_factor
        if n <= soft_start:
            return 0.0
        return penalty_factor * (soft_start - n) / cache_len

    return overlong


# ----- vector rewards and aggregators ----------------------------------------------------------


def weighted_sum(weights: Mapping[str, float] | Sequence[float]) -> Aggregator:
    """Σ weights[k] * components[k]; components without a weight are reported, not summed.

    A sequence of weights applies to the components in their order (e.g. those of a
    `list_reward`, or of a `vector_reward` built from a list): `weighted_sum([0.4, 0.3, 0.3])`.
    """
    if not isinstance(weights, Mapping):
        ordered = [float(w) for w in weights]

        def aggregate_in_order(components: Mapping[str, float]) -> float:
            if len(components) != len(ordered):
                raise ValueError(
                    f"weighted_sum: {len(ordered)} weights for {len(components)} components "
                    f"{list(components)}"
                )
            return sum(w * v for w, v in zip(ordered, components.values(), strict=True))

        return aggregate_in_order

    def aggregate(components: Mapping[str, float]) -> float:
        missing = sorted(set(weights) - set(components))
        if missing:
            raise KeyError(f"weighted_sum: components {missing} were weighted but not computed")
        return sum(w * components[k] for k, w in weights.items())

    return aggregate


def min_aggregate(components: Mapping[str, float]) -> float:
    """The smallest component: a sample is only as good as its worst criterion."""
    return min(components.values())


def max_aggregate(components: Mapping[str, float]) -> float:
    """The largest component: a sample is as good as its best criterion (optimistic)."""
    return max(components.values())


def mean_aggregate(components: Mapping[str, float]) -> float:
    """The mean of the components."""
    return sum(components.values()) / len(components)


def gated(
    gate_key: str,
    threshold: float,
    then: Aggregator | None = None,
    *,
    otherwise: float = 0.0,
) -> Aggregator:
    """`then(components)` if components[gate_key] >= threshold, else `otherwise`.

    E.g. a format gate: no correctness credit unless the answer is well-formed. `then`
    defaults to the plain sum of the other components.
    """

    def aggregate(components: Mapping[str, float]) -> float:
        if components[gate_key] < threshold:
            return otherwise
        if then is not None:
            return then(components)
        return sum(v for k, v in components.items() if k != gate_key)

    return aggregate


def lexicographic(keys: Sequence[str], *, scale: float = 10.0) -> Aggregator:
    """Σ_i components[keys[i]] * scale**(len(keys) - 1 - i): earlier keys dominate.

    The order is strictly lexicographic when every later component's range is smaller than
    `scale` times the smallest gap between distinct values of the earlier ones (e.g. 0/1
    correctness first, then a format score in [0, 1], with scale > 1).
    """

    def aggregate(components: Mapping[str, float]) -> float:
        n = len(keys)
        return sum(components[k] * scale ** (n - 1 - i) for i, k in enumerate(keys))

    return aggregate


def vector_reward(components: Mapping[str, RewardFn] | Sequence[RewardFn],
                  aggregate: Aggregator) -> RewardFn:  # fmt: skip
    """A reward returning each named component plus `aggregate(components)` under "total".

    `components` maps names to rewards, or is a list of rewards named after their functions
    (`[correctness, helpfulness]` → "correctness", "helpfulness"). If any component is async
    the result is async too, and its sync components run in worker threads (as in
    `score_sample`); otherwise it is a plain sync function.

    Raises:
        ConfigError: no components, a component is named "total", or two share a name.
    """
    if not isinstance(components, Mapping):
        names = [reward_name(fn) for fn in components]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"vector_reward: components {repeated} share a name; pass a mapping")
        components = dict(zip(names, components, strict=True))
    if not components:
        raise ConfigError("vector_reward needs at least one component")
    if TOTAL in components:
        raise ConfigError(f"vector_reward: {TOTAL!r} is reserved for the aggregate")
    fns = dict(components)

    def finish(values: dict[str, float]) -> dict[str, float]:
        return {**values, TOTAL: float(aggregate(values))}

    if not any(is_async_reward(fn) for fn in fns.values()):

        def vector(sample: Sample) -> dict[str, float]:
            return finish({k: scalar_reward(fn(sample), k) for k, fn in fns.items()})  # type: ignore[arg-type]

        return vector

    async def vector_async(sample: Sample) -> dict[str, float]:
        return finish({k: scalar_reward(await call_reward(fn, sample), k) for k, fn in fns.items()})

    return vector_async


def list_reward(reward_fn: Callable[[Sample], Sequence[float]], aggregate: Aggregator, *,
                names: Sequence[str] | None = None) -> Callable[[Sample], dict[str, float]]:  # fmt: skip
    """A reward that returns a list of values (the seeds' vector rewards) as a vector reward.

    Component i is named `names[i]` (default "r0", "r1", ...); "total" is `aggregate` of them,
    e.g. `list_reward(multi_objective, weighted_sum([0.4, 0.3, 0.2, 0.1]))` or
    `list_reward(f, mean_aggregate)`.

    Raises (in the returned reward, so the sample is marked failed):
        ValueError: the list's length differs from `names`.
    """

    def from_list(sample: Sample) -> dict[str, float]:
        values = list(reward_fn(sample))
        keys = list(names) if names is not None else [f"r{i}" for i in range(len(values))]
        if len(keys) != len(values):
            raise ValueError(f"{reward_name(reward_fn)} returned {len(values)} values for "
                             f"{len(keys)} names {keys}")  # fmt: skip
        parts = {k: scalar_reward(v, k) for k, v in zip(keys, values, strict=True)}
        return {**parts, TOTAL: float(aggregate(parts))}

    from_list.__name__ = reward_name(reward_fn)
    return from_list


def add_overlong_shaping(
    reward_fn: RewardFn, *, max_response_len: int, cache_len: int, penalty_factor: float = 1.0
) -> RewardFn:
    """`reward_fn` plus DAPO's overlong penalty, as a vector reward with an "overlong" component.

    The inner reward's components (or its scalar, as "task") are kept; "total" = inner total
    + overlong penalty. Async-ness of `reward_fn` is preserved.
    """
    overlong = overlong_penalty(max_response_len, cache_len, penalty_factor)

    def combine(value: RewardValue, sample: Sample) -> dict[str, float]:
        total, parts = split_reward(value)
        penalty = overlong(sample)
        return {**(parts or {"task": total}), "overlong": penalty, TOTAL: total + penalty}

    if not is_async_reward(reward_fn):

        def shaped(sample: Sample) -> dict[str, float]:
            return combine(reward_fn(sample), sample)  # type: ignore[arg-type]

        return shaped

    async def shaped_async(sample: Sample) -> dict[str, float]:
        return combine(await reward_fn(sample), sample)  # type: ignore[misc]

    return shaped_async


class RolloutAlgorithm(Protocol):
    """What the rollout side takes from an RL algorithm (`training.rl.AlgorithmConfig` is one)."""

    @property
    def filter_zero_std(self) -> bool:
        """Dynamic sampling: drop groups whose rewards are all equal, over-sample to refill."""

    @property
    def distill_filter_nats(self) -> float | None:
        """On-policy distillation's dynamic sampling (`rollouts.groups.keep_if_student_errs`):
        keep a group only if a token is this many nats likelier to the student than to the
        teacher; None: off."""

    @property
    def overlong(self) -> Any:
        """None, or DAPO's overlong shaping: `max_response_len`, `cache_len`, `penalty_factor`."""


def shape_reward(algorithm: RolloutAlgorithm, reward_fn: RewardFn) -> RewardFn:
    """`reward_fn` with the algorithm's reward shaping (DAPO's overlong penalty) applied."""
    if algorithm.overlong is None:
        return reward_fn
    return add_overlong_shaping(
        reward_fn,
        max_response_len=algorithm.overlong.max_response_len,
        cache_len=algorithm.overlong.cache_len,
        penalty_factor=algorithm.overlong.penalty_factor,
    )
