"""Pure functions over finished groups: filters, sample transforms, a `RolloutBatch`, metrics.

Why a module of its own: these are the parts of rollout generation a user replaces or tests
with toy samples (a `GroupFilter`, a `SampleTransform`), and they need no engine, no trio and
no thread: `generation.collect_groups` calls them, `rollouts.manager` and the evaluation call
them too.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from rollouts.tools.rewards import tool_metrics
from rollouts.types import RolloutBatch, Sample

if TYPE_CHECKING:
    from rollouts.rewards import RolloutAlgorithm

Group = tuple[Sample, ...]
GroupFilter = Callable[[Group], bool]
SampleTransform = Callable[[Sample], Sample]


def keep_if_reward_varies(group: Group, *, eps: float = 1e-6) -> bool:
    """DAPO dynamic sampling: keep a group only if its rewards are not all equal (std > eps).

    Works for binary and continuous rewards; a group of one sample has no spread.
    """
    rewards = [s.reward for s in group]
    return len(rewards) > 1 and statistics.pstdev(rewards) > eps


def keep_all(group: Group) -> bool:
    return True


def keep_if_student_errs(group: Group, *, nats: float) -> bool:
    """On-policy distillation's dynamic sampling: keep a group only if one of its sampled tokens
    is at least `nats` likelier to the student than to the teacher (log π − log q ≥ nats on a
    trained token: a mistake the teacher would not make).

    A group whose every token the teacher rates about as the student does carries little
    distillation signal (its advantages are all near 0), as a group of equal rewards carries
    no RL signal; dropping it and over-sampling a replacement focuses each step on the prompts
    the student still gets wrong, as DAPO's filter does. Samples without teacher or engine
    logprobs never keep a group.
    """
    for s in group:
        if s.teacher_logprobs and s.rollout_logprobs:
            pairs = zip(s.rollout_logprobs, s.teacher_logprobs, s.loss_mask, strict=True)
            if any(m and p - q >= nats for p, q, m in pairs):
                return True
    return False


def auto_group_filter(algorithm: RolloutAlgorithm) -> GroupFilter:
    """The filter `rollout.filter_groups: auto` means under `algorithm`: the teacher-signal
    filter when `distill_filter_nats` is set, DAPO's when `filter_zero_std`, else none."""
    nats = algorithm.distill_filter_nats
    if nats is not None:
        return functools.partial(keep_if_student_errs, nats=nats)
    return keep_if_reward_varies if algorithm.filter_zero_std else keep_all


def apply_sample_transforms(samples: Sequence[Sample], transforms: Sequence[SampleTransform]
                            ) -> list[Sample]:  # fmt: skip
    """Apply reward shaping / bookkeeping transforms in order (pure)."""
    out = list(samples)
    for transform in transforms:
        out = [transform(s) for s in out]
    return out


def convert_to_batch(groups: Sequence[Group], epoch_id: int, step_id: int,
                     metrics: Mapping[str, float] | None = None,
                     failures: Mapping[str, int] | None = None) -> RolloutBatch:  # fmt: skip
    """Freeze accepted groups into a RolloutBatch with their metrics (pure)."""
    merged = {**rollout_metrics(groups), **(metrics or {})}
    return RolloutBatch(tuple(tuple(g) for g in groups), step_id, epoch_id, merged,
                        dict(failures or {}))  # fmt: skip


def summarize_errors(errors: Mapping[str, int], *, limit: int = 5) -> str:
    """`errors` (text → count) as one line, most frequent first: "12x reward f raised ...; ..."."""
    ranked = sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{n}x {_clip(text)}" for text, n in ranked[:limit]]
    if len(ranked) > limit:
        parts.append(f"and {len(ranked) - limit} other errors")
    return "; ".join(parts)


def failure_line(reward_errors: Mapping[str, int], generation_errors: Mapping[str, int],
                 failure_value: float | None) -> str | None:  # fmt: skip
    """One line counting a batch's failed rewards and generations by cause, and what became of
    their samples (None when nothing failed)."""
    parts = []
    if reward_errors:
        fate = ("generated again, then its group dropped: rollout.reward_failure_value is null"
                if failure_value is None else
                f"trained with rollout.reward_failure_value={failure_value}")  # fmt: skip
        parts.append(f"{sum(reward_errors.values())} rewards failed (each sample {fate}): "
                     f"{summarize_errors(reward_errors)}")  # fmt: skip
    if generation_errors:
        parts.append(f"{sum(generation_errors.values())} samples failed at generation or were "
                     "dropped by their reward (generated again, then the group dropped): "
                     f"{summarize_errors(generation_errors)}")  # fmt: skip
    return "; ".join(parts) or None


def rollout_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Reward, accuracy, length and truncation statistics of accepted groups (pure).

    Each named reward component gets its mean as `reward/<name>` (over the samples that have
    it); "accuracy" is the mean of the "correct" component when there is one. Tool use
    (`tool_calls_per_sample`, `tool_success_rate`, `turns_per_sample`, ...) is always included,
    so a policy that stops calling tools shows up as zeros rather than as missing points.
    """
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    rewards = [s.reward for s in samples]
    lengths = [len(s.response_ids) for s in samples]
    out = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "response_len_mean": statistics.fmean(lengths),
        "response_len_max": float(max(lengths)),
        "truncation_rate": sum(s.status == "truncated" for s in samples) / len(samples),
        "n_samples": float(len(samples)),
    }
    for name in sorted({k for s in samples for k in s.reward_components}):
        values = [s.reward_components[name] for s in samples if name in s.reward_components]
        out[f"reward/{name}"] = statistics.fmean(values)
    if "reward/correct" in out:
        out["accuracy"] = out["reward/correct"]
    return out | tool_metrics(samples)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
