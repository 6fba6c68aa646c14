"""A distillation teacher: scores each sample's tokens as the student sampled them.

On-policy distillation (`training.rl.algorithms.distill`) needs, for every sampled token, the
teacher's logprob given the same prefix. `with_teacher(generate_fn, teacher)` wraps a
`GenerateFn`: once the student's samples of a group are back, each is sent to the teacher
(`score`: SGLang's `/generate` with `max_new_tokens: 0`, `return_logprob: true` and
`logprob_start_len` at the prompt's end, one prefill) and comes back with
`Sample.teacher_logprobs`, one per response token.

Failures are engine failures, with the same accounting (rollouts/generation.py): a teacher that
answers an error, cannot be reached or does not answer within `timeout_s` raises a
`TeacherError` (an `EngineError` whose url reads "teacher <url>"), so the group's samples are
generated again under `rollout.sample_retries` and then the group is dropped and counted in
`groups_failed` and its failure counts ("teacher <url>: timeout", "...: HTTP 500"), or the run
ends at once with `rollout.engine_fail_fast`. A sample is never trained without its teacher
signal (`training.rl.distill` refuses one that has none).

The teacher and the student must share a tokenizer: the teacher scores the student's token ids
as they are. `tokenizer_mismatch` names the first difference (vocabulary, special tokens, the
chat template's rendering of a probe conversation).

Not covered: teachers with another tokenizer (cross-tokenizer distillation re-aligns text
spans; tinker-cookbook notes the same limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import trio

from engines.types import EngineTimeoutError, EngineUnavailableError
from plumbing.errors import EngineError, engine_failure_kind, leaf_errors
from rollouts.generate_fn import GenerateContext, GenerateFn
from rollouts.prompts import PromptItem
from rollouts.types import Sample


class ScoringEngine(Protocol):
    """What a teacher must do: logprobs of `input_ids[start:]` given their prefixes
    (`SGLangEngine.score`, `EnginePool.score`)."""

    async def score(self, input_ids: Sequence[int], start: int, *,
                    temperature: float = 1.0) -> Any: ...  # fmt: skip


class TeacherError(EngineError):
    """The teacher did not score a sample: it answered an error (status kept)."""


class TeacherTimeoutError(TeacherError, EngineTimeoutError):
    """The teacher did not answer within the teacher's `timeout_s`."""


class TeacherUnavailableError(TeacherError, EngineUnavailableError):
    """The teacher could not be reached (or its pool gave up waiting for it)."""


def teacher_name(teacher: Any) -> str:
    """The URL(s) a teacher is reached at, for error messages and failure counts."""
    url = getattr(teacher, "url", None)
    if url:
        return str(url)
    engines = getattr(teacher, "engines", None) or []
    return ",".join(str(getattr(e, "url", e)) for e in engines) or type(teacher).__name__


def _needs_scoring(sample: Sample) -> bool:
    return sample.status not in ("failed", "aborted") and bool(sample.response_ids)


async def score_with_teacher(teacher: ScoringEngine, samples: Sequence[Sample], *,
                             timeout_s: float, name: str = "") -> list[Sample]:  # fmt: skip
    """`samples` with `teacher_logprobs` set by `teacher`, in order (failed, aborted and empty
    samples unchanged). Scored concurrently; all of them within `timeout_s`.

    Raises:
        TeacherTimeoutError: the teacher had not scored them all after `timeout_s`.
        TeacherUnavailableError, TeacherError: a scoring request failed (the cause named).
    """
    name = name or teacher_name(teacher)
    out = list(samples)
    todo = [i for i, s in enumerate(samples) if _needs_scoring(s)]

    async def one(i: int) -> None:
        s = samples[i]
        result = await teacher.score(s.prompt_ids + s.response_ids, len(s.prompt_ids),
                                     temperature=1.0)  # fmt: skip
        logprobs = tuple(float(x) for x in result.logprobs)
        if len(logprobs) != len(s.response_ids):
            raise TeacherError(f"returned {len(logprobs)} logprobs for {len(s.response_ids)} "
                               "response tokens", url=f"teacher {name}")  # fmt: skip
        out[i] = replace(s, teacher_logprobs=logprobs)

    where = f"group {samples[0].group_id}" if samples else "no samples"
    try:
        with trio.fail_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for i in todo:
                    nursery.start_soon(one, i)
    except trio.TooSlowError:
        raise TeacherTimeoutError(
            f"did not score the {len(todo)} samples of {where} within {timeout_s} s "
            "(teacher.timeout_s): is the teacher engine overloaded or hung?",
            url=f"teacher {name}",
        ) from None
    except (EngineError, BaseExceptionGroup) as err:
        exc = next((e for e in leaf_errors(err) if isinstance(e, EngineError)), None)
        if exc is None:
            raise
        raise _teacher_error(exc, name, where) from err
    return out


def _teacher_error(exc: EngineError, name: str, where: str) -> TeacherError:
    """`exc` of a scoring request as a TeacherError of the same kind (timeout, unreachable,
    HTTP status), so the failure counts and the retry policy read it as they read `exc`. A
    pool that gave up is classified by its last failure ("gave up after HTTP 500")."""
    if isinstance(exc, TeacherError):
        return exc
    kind, status = engine_failure_kind(exc), exc.status
    last = str(getattr(exc, "last_kind", None) or "")
    if last.startswith("HTTP ") and last[5:].isdigit():
        status = int(last[5:])
    cls = TeacherError
    if isinstance(exc, TimeoutError) or last in ("timeout", "stalled"):
        cls = TeacherTimeoutError
    elif isinstance(exc, EngineUnavailableError) and status is None:
        cls = TeacherUnavailableError
    err = cls(f"scoring the samples of {where} failed ({kind}): {exc}", url=f"teacher {name}")
    err.status = status  # kept for the retry policy (a 4xx is not retried), not re-printed
    return err


def with_teacher(generate_fn: GenerateFn, teacher: ScoringEngine, *, timeout_s: float = 60.0,
                 name: str = "") -> GenerateFn:  # fmt: skip
    """`generate_fn` whose samples come back scored by `teacher` (`Sample.teacher_logprobs`).

    Samples are reported (scored by the reward) only once the teacher has scored them, so a
    group whose teacher failed is regenerated or dropped whole, never trained half-signalled.
    """

    async def generate(prompt: PromptItem, n: int, ctx: GenerateContext) -> list[Sample]:
        samples = await generate_fn(prompt, n, replace(ctx, report=_ignore))
        scored = await score_with_teacher(teacher, samples, timeout_s=timeout_s, name=name)
        for sample in scored:
            ctx.report(sample)
        return scored

    generate.__name__ = f"with_teacher({getattr(generate_fn, '__name__', 'generate_fn')})"
    return generate


def _ignore(sample: Sample) -> None:
    """Early reports of the wrapped GenerateFn: its samples are reported once scored."""


_PROBE = [{"role": "user", "content": "What is 12+30?"}, {"role": "assistant", "content": "42"}]


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """The first difference between two tokenizers that would make the teacher misread the
    student's token ids, or None when they agree: the vocabulary (token ↔ id), the special
    tokens' ids (eos, pad, bos), and the chat template's ids for a probe conversation."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        s_by_id = {i: t for t, i in sv.items()}
        t_by_id = {i: t for t, i in tv.items()}
        for i in range(max(len(s_by_id), len(t_by_id), max(s_by_id | t_by_id) + 1)):
            if s_by_id.get(i) != t_by_id.get(i):
                return (f"token id {i} is {s_by_id.get(i)!r} for the student and "
                        f"{t_by_id.get(i)!r} for the teacher (vocabularies of {len(sv)} and "
                        f"{len(tv)} tokens)")  # fmt: skip
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id"):
        a, b = getattr(student, attr, None), getattr(teacher, attr, None)
        if a != b:
            return f"{attr} is {a} for the student and {b} for the teacher"
    s_ids, t_ids = _render(student), _render(teacher)
    if s_ids != t_ids:
        if s_ids is None or t_ids is None:
            has = "the student" if s_ids is not None else "the teacher"
            return f"only {has} has a chat template"
        k = next((k for k, (a, b) in enumerate(zip(s_ids, t_ids, strict=False)) if a != b),
                 min(len(s_ids), len(t_ids)))  # fmt: skip
        a = student.convert_ids_to_tokens(s_ids[k]) if k < len(s_ids) else "(end)"
        b = teacher.convert_ids_to_tokens(t_ids[k]) if k < len(t_ids) else "(end)"
        return (f"the chat templates render a probe conversation differently from token {k}: "
                f"{a!r} for the student, {b!r} for the teacher")  # fmt: skip
    return None


def _render(tokenizer: Any) -> list[int] | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    ids = tokenizer.apply_chat_template(_PROBE, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
