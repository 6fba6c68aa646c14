"""The `teacher:` section of an RL config: on-policy distillation's teacher (frozen, strict)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollouts.config import Strict


class TeacherSection(Strict):
    """The teacher of `algorithm.preset: distill` (docs/rl.md, "On-policy distillation"): a
    model directory a local engine is launched on, or an SGLang engine already running. It
    scores the student's samples (rollouts/teacher.py) and must share the student's tokenizer.
    """

    model: str | None = Field(None, description="model directory: a local engine is launched")
    engine_url: str | None = Field(None, description="an SGLang-protocol engine already running")
    api_key: str | None = None
    tokenizer: str | None = Field(
        None, description="engine_url: a local copy of the teacher's tokenizer, compared with "
        "the student's (default: the model_path the engine's /model_info names)",
    )  # fmt: skip
    timeout_s: float = Field(
        60.0, gt=0,
        description="a group's samples not scored within this fail like an engine error "
        "(generated again under rollout.sample_retries, then the group is dropped)",
    )  # fmt: skip
    local_threads: int | None = Field(1, ge=1, description="model: torch threads of its engine")
    local_device: Literal["cpu", "cuda"] = "cpu"
    startup_timeout_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _one_teacher(self) -> TeacherSection:
        if (self.model is None) == (self.engine_url is None):
            raise ValueError("teacher: give model (a directory: a local engine is launched on "
                             "it) or engine_url (a running engine), exactly one")  # fmt: skip
        return self
