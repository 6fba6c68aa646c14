"""RL recipe: the distillation teacher of a config's `teacher:` section (training/teacher_config.py).

`open_teacher` checks that the teacher shares the student's tokenizer (refused before anything
launches, naming both paths and the first differing token), then launches a local engine on
`teacher.model` (supervised: relaunched if it dies, as the student's local engines are) or
connects to the engine at `teacher.engine_url`, and yields an `EnginePool` over it: a failed
scoring request is retried there within `teacher.timeout_s`, and what fails past that reaches
the rollout as a `TeacherError` (rollouts/teacher.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from engines import EnginePool, SGLangEngine
from engines.client import EngineTimeouts, probe_engines
from engines.supervisor import supervise_engine
from plumbing.errors import ConfigError, ModelLoadError
from plumbing.model_paths import resolve_model_dir
from rollouts.generate_fn import GenerateFn
from rollouts.teacher import tokenizer_mismatch, with_teacher
from training.backend.model_io import load_tokenizer
from training.teacher_config import TeacherSection

log = logging.getLogger("rollouts.rl_recipe")


@dataclass(frozen=True)
class Teacher:
    """An open teacher: the pool that scores, the URL it is reached at, its scoring deadline."""

    pool: EnginePool
    url: str
    timeout_s: float

    def wrap(self, generate_fn: GenerateFn) -> GenerateFn:
        """`generate_fn` whose samples come back with this teacher's logprobs."""
        return with_teacher(generate_fn, self.pool, timeout_s=self.timeout_s, name=self.url)


def check_same_tokenizer(student_path: str, teacher_path: str) -> None:
    """Refuse a teacher whose tokenizer would read the student's token ids differently.

    Raises:
        ConfigError: the tokenizers differ (both paths and the first difference named), or the
            teacher's cannot be loaded here.
    """
    student = load_tokenizer(student_path)
    try:
        teacher = load_tokenizer(teacher_path)
    except ModelLoadError as exc:
        raise ConfigError(
            f"teacher: cannot load the teacher's tokenizer from {teacher_path!r} to compare it "
            f"with the student's ({exc}); set teacher.tokenizer=DIR, a local copy of it"
        ) from exc
    why = tokenizer_mismatch(student, teacher)
    if why is not None:
        raise ConfigError(
            f"teacher: the teacher's tokenizer ({teacher_path}) differs from the student's "
            f"({student_path}): {why}. On-policy distillation scores the student's token ids "
            "with the teacher as they are; pick a teacher of the same tokenizer family"
        )


@contextlib.asynccontextmanager
async def open_teacher(section: TeacherSection | None, student_path: str,
                       out: Path) -> AsyncIterator[Teacher | None]:  # fmt: skip
    """The teacher of `section` (None: no teacher), open for the run; see the module docstring.

    Raises:
        ConfigError: the tokenizers differ (`check_same_tokenizer`).
        EngineUnavailableError: nothing answers at `teacher.engine_url`.
        EngineLaunchError: the local teacher engine did not start.
    """
    if section is None:
        yield None
        return
    timeouts = EngineTimeouts(generate_s=section.timeout_s)
    async with contextlib.AsyncExitStack() as stack:
        if section.model is not None:
            teacher_path = resolve_model_dir(section.model)
            check_same_tokenizer(student_path, teacher_path)  # before a process starts
            args = ["--device", section.local_device]
            if section.local_threads:
                args += ["--num-threads", str(section.local_threads)]
            launched = await stack.enter_async_context(supervise_engine(
                kind="local", model_path=teacher_path, extra_args=args,
                log_path=out / "teacher_engine.log", startup_timeout_s=section.startup_timeout_s,
            ))  # fmt: skip
            url = launched.url
        else:
            url = str(section.engine_url)
            await probe_engines([url], api_key=section.api_key, flag="teacher.engine_url")
        client = await stack.enter_async_context(SGLangEngine(
            url, api_key=section.api_key, timeouts=timeouts, retry_generate=False))  # fmt: skip
        if section.model is None:
            info = await client.model_info()
            path = section.tokenizer or info.raw.get("tokenizer_path") or info.model_path
            check_same_tokenizer(student_path, str(path))
        # the pool waits for a relaunched teacher, within half the scoring deadline: its give-up
        # (naming the last failure) comes before the deadline's plain "timeout"
        pool = await stack.enter_async_context(EnginePool(
            [client], unavailable_timeout_s=section.timeout_s / 2, stall_floor_s=None,
            stall_s_per_token=None,
        ))  # fmt: skip
        log.info("distillation teacher at %s (%s)", url, section.model or "running engine")
        yield Teacher(pool, url, section.timeout_s)
