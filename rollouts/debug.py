"""Looking at rollouts: a readable dump of one sample, and a consistency check of a batch.

`inspect_rollout(sample, tokenizer)` shows what the trainer will see: each response token with
its loss-mask bit and engine logprob, the reward and its components, status, tool calls.
`validate_batch(batch)` lists what would make a batch train wrongly or not at all; call it on
a batch from a new environment or reward before a long run, or in `on_batch` while debugging.
`sample_line(sample, tokenizer)` is the short form the RL loop logs every `train.sample_every`
steps: prompt, response and reward on one line, each text shortened.
No torch; the only I/O is `inspect_rollout` printing what it returns.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rollouts.types import RolloutBatch, Sample

Severity = Literal["error", "warning"]


def inspect_rollout(sample: Sample, tokenizer: Any = None, *, max_tokens: int = 200,
                    file: Any = None, quiet: bool = False) -> str:  # fmt: skip
    """Print a multi-line description of `sample`, one line per response token, and return it.

    Args:
        sample: the trajectory.
        tokenizer: decodes the prompt and each token (None: ids only).
        max_tokens: response tokens listed; the rest are summarised in one line.
        file: where it is printed (default: sys.stdout at the time of the call).
        quiet: print nothing, only return the text.

    Returns:
        The text printed.
    """
    text = _describe(sample, tokenizer, max_tokens)
    if not quiet:
        print(text, file=sys.stdout if file is None else file)
    return text


def _describe(sample: Sample, tokenizer: Any, max_tokens: int) -> str:

    def text(ids: Sequence[int]) -> str:
        return repr(tokenizer.decode(list(ids))) if tokenizer is not None else ""

    head = (
        f"sample group={sample.group_id} index={sample.index_in_group} status={sample.status} "
        f"finish_reason={sample.finish_reason} weight_version={sample.weight_version}"
    )
    lines = [head]
    if sample.error:
        lines.append(f"error: {sample.error}")
    parts = " ".join(f"{k}={v:.4g}" for k, v in sample.reward_components.items())
    lines.append(f"reward: {sample.reward:.4g}" + (f" ({parts})" if parts else ""))
    if sample.metadata:
        lines.append(f"metadata: {dict(sample.metadata)}")
    lines.append(f"prompt: {len(sample.prompt_ids)} tokens {text(sample.prompt_ids)}")
    n, n_trained = len(sample.response_ids), sample.num_trained_tokens
    lines.append(f"response: {n} tokens, {n_trained} trained (mask=1) {text(sample.response_ids)}")
    lines.append("    pos       id  mask   logprob  token")
    for t, token_id in enumerate(sample.response_ids[:max_tokens]):
        logprob = f"{sample.rollout_logprobs[t]:9.4f}" if sample.rollout_logprobs else "        -"
        lines.append(
            f"  {t:5d} {token_id:8d}  {sample.loss_mask[t]:4d} {logprob}  {text([token_id])}"
        )
    if n > max_tokens:
        lines.append(f"  ... {n - max_tokens} more tokens")
    for i, call in enumerate(sample.tool_calls):
        outcome = "ok" if call.success else f"failed: {call.error}"
        lines.append(
            f"tool call {i}: {call.name}({dict(call.arguments)}) -> {call.output!r} "
            f"[{outcome}, {call.latency_s:.3f}s]"
        )
    return "\n".join(line.rstrip() for line in lines)


def shorten(text: str, max_chars: int, *, keep: Literal["head", "tail"] = "head") -> str:
    """`text` on one line (newlines shown as ⏎), at most about `max_chars` characters: its head
    or its tail kept, the cut said with how many characters it dropped."""
    flat = text.replace("\r", "").replace("\n", "⏎")
    if len(flat) <= max_chars:
        return flat
    cut = f"…[{len(flat) - max_chars} chars]…"
    return flat[:max_chars] + cut if keep == "head" else cut + flat[-max_chars:]


def sample_line(sample: Sample, tokenizer: Any = None, *, max_chars: int = 160) -> str:
    """One sample on one line: its prompt's end, its response's start, its reward and status.

    The prompt keeps its tail (a chat template puts the question last), the response its head.
    """
    if tokenizer is not None:
        prompt = repr(shorten(tokenizer.decode(list(sample.prompt_ids)), max_chars, keep="tail"))
    else:
        prompt = f"<{len(sample.prompt_ids)} tokens>"
    response_text = sample.response_text
    if not response_text and tokenizer is not None:
        response_text = tokenizer.decode(list(sample.response_ids))
    response = repr(shorten(response_text, max_chars))
    parts = " ".join(f"{k}={v:.3g}" for k, v in sample.reward_components.items())
    reward = f"{sample.reward:.4g}" + (f" ({parts})" if parts else "")
    status = "" if sample.status == "completed" else f" [{sample.status}]"
    return (f"prompt {prompt} -> response {response} ({len(sample.response_ids)} tokens) "
            f"reward {reward}{status}")  # fmt: skip


@dataclass(frozen=True)
class BatchProblem:
    """One finding of `validate_batch`; group/index are None for batch-wide findings."""

    severity: Severity
    group: int | None
    index: int | None
    message: str

    def __str__(self) -> str:
        where = "batch" if self.group is None else f"group {self.group}"
        if self.index is not None:
            where += f" sample {self.index}"
        return f"{self.severity}: {where}: {self.message}"


@dataclass(frozen=True)
class BatchReport:
    """What `validate_batch` found; `ok` is False when there is any error (warnings allowed)."""

    problems: tuple[BatchProblem, ...]
    n_groups: int
    n_samples: int

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> tuple[BatchProblem, ...]:
        return tuple(p for p in self.problems if p.severity == "error")

    @property
    def warnings(self) -> tuple[BatchProblem, ...]:
        return tuple(p for p in self.problems if p.severity == "warning")

    def __str__(self) -> str:
        head = (
            f"batch of {self.n_groups} groups / {self.n_samples} samples: "
            f"{len(self.errors)} errors, {len(self.warnings)} warnings"
        )
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def validate_batch(batch: RolloutBatch, *, group_size: int | None = None) -> BatchReport:
    """Check a batch for samples and groups that would train wrongly.

    Errors: an empty batch; groups whose size differs from `group_size` (default: the most
    common size), mixed prompts or group ids within a group; non-finite rewards or reward
    components; loss-mask values other than 0/1; non-finite or positive engine logprobs on
    trained tokens.
    Warnings: failed/aborted samples, empty responses or ones with no trained token (they
    carry no gradient), trained tokens without engine logprobs, and weight versions mixed
    within a group or across the batch (normal in async mode, a bug in sync mode).
    Per-token lengths (loss_mask, rollout_logprobs vs response_ids) are enforced by `Sample`
    itself on construction.
    """
    problems: list[BatchProblem] = []

    def add(severity: Severity, g: int | None, i: int | None, message: str) -> None:
        problems.append(BatchProblem(severity, g, i, message))

    if not batch.groups:
        add("error", None, None, "no groups")
    # An agent session's other branches (sub_index > 0) are extra samples, not group members.
    sizes = Counter(sum(s.sub_index == 0 for s in g) for g in batch.groups)
    expected = group_size if group_size is not None else (sizes.most_common(1) or [(0, 0)])[0][0]
    for g, group in enumerate(batch.groups):
        n = sum(s.sub_index == 0 for s in group)
        if n != expected:
            add("error", g, None, f"{n} samples, expected {expected}")
        if len({s.prompt_ids for s in group}) > 1:
            add("error", g, None, "samples have different prompts")
        if len({s.group_id for s in group}) > 1:
            add("error", g, None, f"mixed group_ids {sorted({s.group_id for s in group})}")
        versions = sorted({s.weight_version for s in group})
        if len(versions) > 1:
            add("warning", g, None, f"mixed weight versions {versions}")
        for i, sample in enumerate(group):
            for severity, message in _sample_problems(sample):
                add(severity, g, i, message)
    versions = sorted({s.weight_version for s in batch.samples})
    if len(versions) > 1:
        add("warning", None, None, f"weight versions {versions} (off-policy samples)")
    return BatchReport(tuple(problems), len(batch.groups), len(batch.samples))


def _sample_problems(sample: Sample) -> list[tuple[Severity, str]]:
    out: list[tuple[Severity, str]] = []
    if sample.status in ("failed", "aborted"):
        out.append(("warning", f"status {sample.status}: {sample.error or 'no error text'}"))
    if not math.isfinite(sample.reward):
        out.append(("error", f"reward is {sample.reward}"))
    bad = {k: v for k, v in sample.reward_components.items() if not math.isfinite(v)}
    if bad:
        out.append(("error", f"non-finite reward components {bad}"))
    if not sample.response_ids:
        out.append(("warning", "empty response"))
    elif sample.num_trained_tokens == 0:
        out.append(("warning", "no trained token (loss_mask all 0)"))
    if set(sample.loss_mask) - {0, 1}:
        out.append(("error", f"loss_mask values {sorted(set(sample.loss_mask))}, expected 0/1"))
    if sample.num_trained_tokens and not sample.rollout_logprobs:
        out.append(("warning", "no engine logprobs: no off-policy correction or mismatch metrics"))
    trained = [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=False) if m]
    odd = [lp for lp in trained if not math.isfinite(lp) or lp > 0]
    if odd:
        out.append(("error", f"{len(odd)} trained-token logprobs non-finite or > 0: {odd[:3]}"))
    return out
