"""Record types that flow from generation to training: tool calls, samples, groups, batches.

Records are frozen dataclasses: change one with its helpers (`with_reward`, `failed`) or
`dataclasses.replace`, never in place, so a sample handed to a logger, a buffer and the
trainer is the same value everywhere. Token ids and engine logprobs travel end to end; text is
kept for rewards and logs, never re-tokenized to train on.

Sequence fields are normalised to tuples and mapping fields copied to plain dicts on
construction, so callers may pass lists; a `TokenArray` (rollouts/token_arrays.py: a read-only
numpy view that equals and hashes as the tuple of its values) is kept as it is, so samples
decoded from a rollout worker's frame hold no Python object per token. Mappings are not
deep-frozen: treat `metadata` and `reward_components` as read-only.

`to_dict` / `from_dict` give a JSON-serialisable round trip (checkpointed held groups, rollout
dumps); `metadata` and tool-call `arguments` must themselves be JSON-serialisable for that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from plumbing.errors import DataError
from rollouts.token_arrays import TokenArray

Status = Literal["completed", "truncated", "aborted", "failed"]
STATUSES: tuple[Status, ...] = ("completed", "truncated", "aborted", "failed")


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call made during a trajectory, with what it returned and how long it took."""

    name: str
    arguments: Mapping[str, Any]
    output: str
    success: bool
    latency_s: float = 0.0
    error: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", dict(self.arguments))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (if `arguments` is)."""
        return {
            "name": self.name,
            "arguments": dict(self.arguments),
            "output": self.output,
            "success": self.success,
            "latency_s": self.latency_s,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ToolCallRecord:
        """Inverse of `to_dict`.

        Raises:
            DataError: a required key is missing or an unknown key is present.
        """
        return cls(**_checked_fields(cls, d))


@dataclass(frozen=True)
class Sample:
    """One trajectory: the prompt and response tokens, what to train on, and how it scored.

    Attributes:
        prompt_ids: prompt token ids as sent to the engine.
        response_ids: every token after the prompt: model tokens and, in multi-turn
            rollouts, tool/environment tokens.
        loss_mask: one per response token; 1 on tokens the model sampled (trained), 0 on
            tool/environment tokens.
        rollout_logprobs: engine logprob of each response token (placeholder 0.0 on tokens
            the model did not sample), or empty when the engine returned none.
        reward: the scalar the advantage estimators use.
        reward_components: named parts of a vector reward (the aggregate is `reward`).
        status: completed / truncated (hit the length limit) / aborted (cut short, e.g. at a
            weight update) / failed (generation, tool or reward error; see `error`).
        group_id, index_in_group: position in the group of samples drawn for one prompt.
        sub_index: 0 for the sample that stands for its `index_in_group` (one of the group's
            n); 1, 2, ... for further samples of the same rollout, trained as samples of
            their own but not counted toward n (an agent session's other branches).
        weight_version: version of the engine weights that generated the response.
        metadata: the prompt record's extra fields (e.g. {"answer": "46"}), for rewards.
        tool_calls: tool calls made during the trajectory, in order.
        finish_reason: the engine's finish reason ("stop", "length", "abort", ...).
        teacher_logprobs: a distillation teacher's logprob of each response token given the
            same prefix (rollouts/teacher.py), or empty when no teacher scored the sample.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...] = ()
    response_text: str = ""
    reward: float = 0.0
    reward_components: Mapping[str, float] = field(default_factory=dict)
    status: Status = "completed"
    error: str | None = None
    group_id: int = 0
    index_in_group: int = 0
    sub_index: int = 0
    weight_version: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict)
    tool_calls: tuple[ToolCallRecord, ...] = ()
    finish_reason: str | None = None
    teacher_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        # A TokenArray (a read-only view of a rollout worker's frame) is kept as it is.
        if type(self.prompt_ids) is not TokenArray:
            set_(self, "prompt_ids", tuple(self.prompt_ids))
        if type(self.response_ids) is not TokenArray:
            set_(self, "response_ids", tuple(self.response_ids))
        if type(self.loss_mask) is not TokenArray:
            set_(self, "loss_mask", tuple(self.loss_mask))
        if type(self.rollout_logprobs) is not TokenArray:
            set_(self, "rollout_logprobs", tuple(self.rollout_logprobs))
        if type(self.teacher_logprobs) is not TokenArray:
            set_(self, "teacher_logprobs", tuple(self.teacher_logprobs))
        set_(self, "reward_components", dict(self.reward_components))
        set_(self, "metadata", dict(self.metadata))
        set_(self, "tool_calls", tuple(self.tool_calls))
        self._check()

    def _check(self) -> None:
        n = len(self.response_ids)
        if len(self.loss_mask) != n:
            raise ValueError(
                f"Sample (group {self.group_id}, index {self.index_in_group}): loss_mask has "
                f"{len(self.loss_mask)} entries for {n} response tokens; give one per token"
            )
        if len(self.rollout_logprobs) not in (0, n):
            raise ValueError(
                f"Sample (group {self.group_id}, index {self.index_in_group}): "
                f"rollout_logprobs has {len(self.rollout_logprobs)} entries for {n} response "
                "tokens; give one per token (0.0 on tool tokens) or none"
            )
        if len(self.teacher_logprobs) not in (0, n):
            raise ValueError(
                f"Sample (group {self.group_id}, index {self.index_in_group}): "
                f"teacher_logprobs has {len(self.teacher_logprobs)} entries for {n} response "
                "tokens; give one per token or none"
            )
        if self.status not in STATUSES:
            raise ValueError(f"Sample status {self.status!r} is not one of {STATUSES}")

    @classmethod
    def from_token_arrays(cls, record: Mapping[str, Any], prompt_ids: TokenArray,
                          response_ids: TokenArray, loss_mask: TokenArray,
                          rollout_logprobs: TokenArray) -> Sample:  # fmt: skip
        """The sample `from_dict` gives for `record` (as `to_dict` writes it, without the token
        fields; keys at their default may be left out) with these token fields.

        Built without `__init__`'s per-field normalisation, which the record does not need
        (~1 us instead of ~5: a trainer decodes thousands per step from its rollout workers'
        frames, rollouts/workers/frames.py); the same checks run.

        Raises:
            DataError: `record` has a key that is not a Sample field (or a token field).
            ValueError: inconsistent lengths, or an unknown status.
        """
        unknown = record.keys() - _RECORD_KEYS
        if unknown:
            raise DataError(f"Sample record has unknown keys {sorted(unknown)}; expected "
                            f"{sorted(_RECORD_KEYS)}")  # fmt: skip
        sample = _new(cls)
        values = sample.__dict__  # a frozen dataclass: fields are set here once, never after
        values.update(_IMMUTABLE_DEFAULTS)
        values.update(record)
        values["prompt_ids"], values["response_ids"] = prompt_ids, response_ids
        values["loss_mask"], values["rollout_logprobs"] = loss_mask, rollout_logprobs
        values["reward_components"] = dict(record.get("reward_components", ()))
        values["metadata"] = dict(record.get("metadata", ()))
        if record.get("tool_calls"):
            values["tool_calls"] = tuple(ToolCallRecord.from_dict(t) for t in record["tool_calls"])
        if "teacher_logprobs" in record:
            values["teacher_logprobs"] = tuple(record["teacher_logprobs"])
        sample._check()
        return sample

    @property
    def num_trained_tokens(self) -> int:
        """Response tokens the loss sees (loss_mask == 1)."""
        mask = self.loss_mask
        return sum(mask) if type(mask) is not TokenArray else mask.sum()

    def with_reward(self, reward: float, components: Mapping[str, float] | None = None) -> Sample:
        """A copy scored with `reward`; `components` replaces the old ones (None → none)."""
        return dataclasses.replace(
            self, reward=float(reward), reward_components=dict(components or {})
        )

    def failed(self, error: str) -> Sample:
        """A copy marked failed with `error`; tokens and reward are kept for inspection."""
        return dataclasses.replace(self, status="failed", error=error)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (if `metadata` is); `Sample.from_dict` inverts it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs",
                    "teacher_logprobs"):  # fmt: skip
            values = out[key]
            out[key] = values.tolist() if type(values) is TokenArray else list(values)
        out["reward_components"] = dict(self.reward_components)
        out["metadata"] = dict(self.metadata)
        out["tool_calls"] = [t.to_dict() for t in self.tool_calls]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Sample:
        """Inverse of `to_dict`; missing optional keys take their defaults.

        Raises:
            DataError: a required key is missing, an unknown key is present, or the values
                are inconsistent (e.g. loss_mask length).
        """
        kwargs = _checked_fields(cls, d)
        kwargs["tool_calls"] = tuple(
            ToolCallRecord.from_dict(t) for t in kwargs.get("tool_calls", ())
        )
        try:
            return cls(**kwargs)
        except ValueError as exc:
            raise DataError(f"invalid sample record: {exc}") from exc


_new = object.__new__
_TOKEN_FIELDS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs")
_RECORD_KEYS = frozenset(f.name for f in dataclasses.fields(Sample)) - set(_TOKEN_FIELDS)
_IMMUTABLE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Sample)
                       if f.default is not dataclasses.MISSING}  # fmt: skip

Group: TypeAlias = tuple[Sample, ...]
"""The n samples drawn for one prompt: GRPO's unit."""


@dataclass(frozen=True)
class RolloutBatch:
    """The groups for one training step, with the step/epoch that produced them and metrics."""

    groups: tuple[Group, ...]
    step_id: int
    epoch_id: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    failures: Mapping[str, int] = field(default_factory=dict)
    """Why samples of rejected groups failed: error text → count (e.g. a reward that raised)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(tuple(g) for g in self.groups))
        object.__setattr__(self, "metrics", dict(self.metrics))
        object.__setattr__(self, "failures", dict(self.failures))

    @property
    def samples(self) -> tuple[Sample, ...]:
        """All samples, group-major (group 0's samples first)."""
        return tuple(s for g in self.groups for s in g)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; `RolloutBatch.from_dict` inverts it."""
        return {
            "groups": [[s.to_dict() for s in g] for g in self.groups],
            "step_id": self.step_id,
            "epoch_id": self.epoch_id,
            "metrics": dict(self.metrics),
            "failures": dict(self.failures),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RolloutBatch:
        """Inverse of `to_dict`.

        Raises:
            DataError: a key is missing or unknown, or a sample record is invalid.
        """
        kwargs = _checked_fields(cls, d)
        kwargs["groups"] = tuple(
            tuple(Sample.from_dict(s) for s in g) for g in kwargs.get("groups", ())
        )
        return cls(**kwargs)


def _checked_fields(cls: type, d: Mapping[str, Any]) -> dict[str, Any]:
    """`d` as constructor kwargs for dataclass `cls`, rejecting unknown and missing keys."""
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = sorted(set(d) - names)
    if unknown:
        raise DataError(
            f"{cls.__name__} record has unknown keys {unknown}; expected {sorted(names)}"
        )
    required = [
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in d]
    if missing:
        raise DataError(f"{cls.__name__} record is missing required keys {missing}")
    return dict(d)
