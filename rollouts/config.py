"""Rollout configuration (pydantic, frozen, unknown keys rejected) and the config base class."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    """Base for every config section: immutable, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    max_new_tokens: int = Field(16, ge=1)
    stop: list[str] = []
    stop_token_ids: list[int] = []

    def params(self) -> dict:
        """SGLang `sampling_params` for these settings."""
        out: dict = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
        }
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        return out


class RolloutConfig(Strict):
    batch_size: int = Field(8, ge=1, description="prompt groups per training step")
    n_samples_per_prompt: int = Field(8, ge=1)
    max_concurrency: int = Field(64, ge=1, description="requests in flight across engines")
    sampling: SamplingConfig = SamplingConfig()
    mode: Literal["sync", "overlap", "async"] = "sync"
    max_staleness: int = Field(1, ge=0, description="async mode: weight versions a sample may lag")
    stale_policy: Literal["drop", "regenerate"] = "regenerate"
    filter_groups: Literal["auto", "reward_varies", "none"] = Field(
        "auto", description="auto: as the algorithm says (DAPO's dynamic sampling filters)"
    )
    extra_groups: int = Field(0, ge=0, description="groups launched beyond batch_size up front")
    max_launch_factor: float = Field(4.0, ge=1, description="cap on groups launched per batch")
    reward_timeout_s: float = Field(30.0, gt=0)
    reward_threads: int = Field(
        32, ge=1, description="sync reward calls running at once (their own thread pool)"
    )
    reward_max_hung: int = Field(
        256, ge=0,
        description="sync reward threads still running past their timeout before the run ends",
    )  # fmt: skip
    stall_warning_s: float = Field(
        5.0, gt=0,
        description="log the function holding the event loop when it stalls this long "
        "(e.g. an async reward that blocks)",
    )  # fmt: skip
    reward_fail_fast: bool = False
    engine_fail_fast: bool = Field(
        False, description="an engine error ends the run at once instead of dropping the group"
    )
    sample_retries: int = Field(
        1, ge=0,
        description="times a failed sample (engine error, DropSample) is generated again "
        "before its group is dropped",
    )  # fmt: skip
    reward_failure_value: float | None = Field(
        None,
        description="null: a sample whose reward raised, timed out or gave no number fails "
        "(generated again under sample_retries, then its group is dropped), never trained on a "
        "made-up reward; a number: such a sample is trained with this reward (error kept on it)",
    )
    max_failed_group_rate: float = Field(
        0.25, ge=0, le=1,
        description="end the run when more than this share of a batch's groups failed",
    )  # fmt: skip
    workers: int = Field(
        0, ge=0,
        description="rollout worker processes generating and scoring (rollouts/workers/; "
        "docs/scale.md); 0: in the trainer's process. Every rollout.mode",
    )  # fmt: skip
    worker_timeout_s: float = Field(
        600.0, gt=0, description="a worker's answer to one request; past it the worker is "
        "killed, restarted and its groups generated again",
    )  # fmt: skip
    worker_restarts: int = Field(
        3, ge=0, description="restarts of one worker within one batch before the run ends"
    )
