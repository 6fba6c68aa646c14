"""Tokenize SFT conversations with assistant-only loss masks, for any chat template.

How the mask is found: for every trained assistant turn i, the tokenizer's own chat template
renders `messages[:i]`, the same with `add_generation_prompt=True` (which appends the assistant
role header) and `messages[:i+1]`, and the token ids are diffed. The tokens the assistant message
adds after its header are trained; everything else (system, user and tool turns, role headers,
tool schemas) is not. No `{% generation %}` markers are needed, so any template works as long
as it is prefix-stable.

What is guaranteed:
- The prefix property is VERIFIED: `messages[:i]` must be a prefix of both its generation-prompt
  render and `messages[:i+1]`, which must be a prefix of the next turn's `messages[:j]` and of
  the full conversation. A template that rewrites history (e.g. one that strips past
  reasoning) raises `DataError` naming the record instead of training on misaligned masks.
  Renders are taken only at assistant turns, so templates that merge consecutive
  non-assistant messages (Qwen2.5 groups tool results into one turn) still work.
- The end-of-turn token (`<|im_end|>` for ChatML) of an assistant turn is trained; whitespace
  the template writes after the turn's last special token (ChatML's "\\n") is not, since the
  model stops at the end token and never generates it.
- If the generation prompt is not a prefix of the rendered turn (templates that add something
  like an empty think block only for generation), the header ends where the two renders
  diverge, so only tokens the turn itself contributes are trained.
- The first token is never marked trained (nothing predicts it), so `n_trained` equals the
  number of loss terms the sample contributes once shifted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from plumbing.errors import ConfigError, DataError
from rollouts.jsonl import format_errors
from training.data.accounting import DataIssue
from training.data.sft_data import SFTRecord

Overlong = Literal["truncate", "drop"]


@dataclass(frozen=True)
class TokenizedSample:
    """One conversation as token ids plus a per-token loss mask (1 = trained assistant token)."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    source: str

    @property
    def n_trained(self) -> int:
        """How many tokens carry a loss."""
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class TokenizeStats:
    """What `tokenize_records` kept, cut and dropped; nothing disappears without a count here.

    `n_records == n_kept + n_dropped_overlong + n_dropped_empty`. An over-long record counts
    once: in `n_truncated` when kept after the cut, in `n_dropped_overlong` when dropped
    (`overlong="drop"`, or the cut left it no trained token). `n_dropped_empty` counts records
    that were not over-long and still had no trained token. `n_tokens` and `n_trained_tokens`
    count the kept samples after truncation; `n_truncated_tokens` counts the tokens cut from
    the `n_truncated` kept samples. `issues` names every record cut or dropped, in order.
    """

    n_records: int
    n_kept: int
    n_truncated: int
    n_dropped_overlong: int
    n_dropped_empty: int
    n_tokens: int
    n_trained_tokens: int
    n_truncated_tokens: int
    issues: tuple[DataIssue, ...] = ()
    longest: int = 0  # tokens of the longest sample before any cut

    @property
    def n_overlong(self) -> int:
        """Samples longer than the limit (truncated or dropped)."""
        return self.n_truncated + self.n_dropped_overlong

    def summary(self) -> str:
        """One line for the log."""
        return (
            f"{self.n_records} records → {self.n_kept} samples "
            f"({self.n_tokens} tokens, {self.n_trained_tokens} trained); "
            f"truncated {self.n_truncated} ({self.n_truncated_tokens} tokens cut), "
            f"dropped {self.n_dropped_overlong} over-long, "
            f"{self.n_dropped_empty} with no trained tokens"
        )


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    source: str = "",
    template_kwargs: Mapping[str, Any] | None = None,
    special_ids: frozenset[int] | None = None,
) -> TokenizedSample:
    """Render one conversation with the chat template and mark the assistant tokens.

    Args:
        tokenizer: an HF tokenizer with a chat template.
        messages: OpenAI/HF chat messages; assistant messages with `weight` 0 are not trained.
        tools: tool schemas, passed through to the template.
        source: where the conversation came from ("path:line"), for error messages.
        template_kwargs: extra variables for the template (e.g. `{"enable_thinking": False}`).
        special_ids: the tokenizer's special token ids, if the caller already has them (they
            cost more to collect than a short conversation costs to render).

    Returns:
        The sample; it may have `n_trained == 0` if the template renders nothing for the
        assistant turns (callers decide whether to drop it).

    Raises:
        DataError: if the template fails to render, or violates the prefix property.
    """
    messages = list(messages)
    render = _Renderer(tokenizer, tools, source, template_kwargs or {})
    full = render(messages, generation_prompt=False)
    if special_ids is None:
        special_ids = _special_ids(tokenizer)
    loss_mask = [0] * len(full)
    prev: list[int] = []
    prev_what = "the start"
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant" or msg.get("weight", 1) == 0:
            continue
        if i == 0:
            raise DataError(
                f"{source}: messages[0]: a trained assistant turn cannot open the conversation "
                "(an empty conversation has no generation prompt to find its role header)"
            )
        before = f"messages[:{i}]"
        context = render(messages[:i], generation_prompt=False)
        with_header = render(messages[:i], generation_prompt=True)
        with_turn = render(messages[: i + 1], generation_prompt=False)
        _check_prefix(prev, context, source, prev_what, before)
        _check_prefix(context, with_header, source, before, f"{before} + generation prompt")
        _check_prefix(context, with_turn, source, before, f"messages[:{i + 1}]")
        start = max(len(context), _common_prefix_len(with_header, with_turn))
        end = _end_of_turn(with_turn, start, special_ids, tokenizer)
        loss_mask[start:end] = [1] * (end - start)
        prev, prev_what = with_turn, f"messages[:{i + 1}]"
    _check_prefix(prev, full, source, prev_what, "the full conversation")
    if loss_mask:
        loss_mask[0] = 0
    return TokenizedSample(input_ids=tuple(full), loss_mask=tuple(loss_mask), source=source)


def tokenize_records(
    records: Iterable[SFTRecord],
    tokenizer: Any,
    *,
    max_seq_len: int,
    overlong: Overlong = "truncate",
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[TokenizedSample], TokenizeStats]:
    """Tokenize every record, then truncate or drop over-long samples and count what was lost.

    Args:
        records: validated records, e.g. from `load_sft_jsonl`.
        tokenizer: an HF tokenizer with a chat template.
        max_seq_len: the longest sample kept, in tokens.
        overlong: "truncate" cuts a longer sample to `max_seq_len`; "drop" drops it. A sample
            left with no trained token (e.g. its assistant turns were all cut) is dropped.
        template_kwargs: extra variables for the template.

    Returns:
        The kept samples in record order, and the counts.

    Raises:
        ConfigError: if `max_seq_len` < 2 or `overlong` is not "truncate" or "drop".
        DataError: listing every record the template cannot render prefix-stably (first 10).
    """
    if overlong not in ("truncate", "drop"):
        raise ConfigError(f"overlong: expected 'truncate' or 'drop', got {overlong!r}")
    if max_seq_len < 2:
        raise ConfigError(f"max_seq_len: must be at least 2, got {max_seq_len}")
    kept: list[TokenizedSample] = []
    errors: list[str] = []
    n_records = n_truncated = n_dropped_overlong = n_dropped_empty = n_truncated_tokens = 0
    issues: list[DataIssue] = []
    longest = 0
    special_ids = _special_ids(tokenizer)
    for record in records:
        n_records += 1
        try:
            sample = tokenize_conversation(
                tokenizer,
                record.messages,
                record.tools,
                source=record.source,
                template_kwargs=template_kwargs,
                special_ids=special_ids,
            )
        except DataError as e:
            errors.append(str(e))
            continue
        n_cut = max(0, len(sample) - max_seq_len)
        longest = max(longest, len(sample))
        issue = partial(DataIssue, sample.source, len(sample), max_seq_len, tokens_cut=n_cut)
        if n_cut and overlong == "drop":
            n_dropped_overlong += 1
            issues.append(issue("dropped over-long"))
            continue
        if n_cut:
            sample = TokenizedSample(
                input_ids=sample.input_ids[:max_seq_len],
                loss_mask=sample.loss_mask[:max_seq_len],
                source=sample.source,
            )
        if sample.n_trained == 0:  # an over-long record cut to no trained token is over-long
            if n_cut:
                n_dropped_overlong += 1
            else:
                n_dropped_empty += 1
            issues.append(issue("no trained tokens left"))
            continue
        if n_cut:
            n_truncated += 1
            n_truncated_tokens += n_cut
            issues.append(issue("cut"))
        kept.append(sample)
    if errors:
        raise DataError(format_errors(errors, what="the chat-template rendering"))
    stats = TokenizeStats(
        n_records=n_records,
        n_kept=len(kept),
        n_truncated=n_truncated,
        n_dropped_overlong=n_dropped_overlong,
        n_dropped_empty=n_dropped_empty,
        n_tokens=sum(len(s) for s in kept),
        n_trained_tokens=sum(s.n_trained for s in kept),
        n_truncated_tokens=n_truncated_tokens,
        issues=tuple(issues),
        longest=longest,
    )
    return kept, stats


class _Renderer:
    """Calls `apply_chat_template` for prefixes of one conversation, wrapping failures.

    Every call renders a prefix `messages[:n]` of the same conversation, so a render is kept by
    (n, generation_prompt): the last assistant turn's `messages[:i+1]` is the whole
    conversation, rendered once instead of twice (a quarter of a two-message record's cost).
    """

    def __init__(self, tokenizer: Any, tools, source: str, template_kwargs: Mapping[str, Any]):
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self.source = source
        self.template_kwargs = template_kwargs
        self._done: dict[tuple[int, bool], list[int]] = {}

    def __call__(self, messages: list, *, generation_prompt: bool) -> list[int]:
        key = (len(messages), generation_prompt)
        if key not in self._done:
            self._done[key] = self._render(messages, generation_prompt)
        return list(self._done[key])

    def _render(self, messages: list, generation_prompt: bool) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=self.tools,
                tokenize=True,
                add_generation_prompt=generation_prompt,
                return_dict=False,
                # we measure and cut lengths ourselves (tokenize_records): no "indexing errors"
                # warning from transformers for a record longer than model_max_length
                tokenizer_kwargs={"verbose": False},
                **self.template_kwargs,
            )
        except Exception as e:  # jinja raises many types (TemplateError, TypeError, ...)
            what = f"messages[:{len(messages)}]" + (" + generation prompt" * generation_prompt)
            raise DataError(
                f"{self.source}: the chat template failed to render {what}: {type(e).__name__}: {e}"
            ) from e
        if isinstance(ids, Mapping):  # some tokenizers ignore return_dict=False
            ids = ids["input_ids"]
        return list(ids)


def _check_prefix(prefix: list[int], ids: list[int], source: str, a: str, b: str) -> None:
    if ids[: len(prefix)] == prefix:
        return
    at = _common_prefix_len(prefix, ids)
    raise DataError(
        f"{source}: the chat template is not prefix-stable: the tokens of {a} are not a prefix "
        f"of the tokens of {b} (they differ at token {at}), so assistant-only loss masks "
        "cannot be derived; use a template that renders earlier turns the same way whatever "
        "follows them"
    )


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _end_of_turn(ids: list[int], start: int, special_ids: frozenset[int], tokenizer) -> int:
    """End (exclusive) of the trained span: drop whitespace written after the last special token."""
    end = len(ids)
    last_special = max((j for j in range(start, end) if ids[j] in special_ids), default=None)
    if last_special is None:
        return end
    trailing = ids[last_special + 1 : end]
    if trailing and not tokenizer.decode(trailing).strip():
        return last_special + 1
    return end


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False):
            ids.add(token_id)
    return frozenset(ids)
