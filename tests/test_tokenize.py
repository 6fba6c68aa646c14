"""Assistant-only loss masks from chat-template prefix diffs, and over-long sample accounting."""

from __future__ import annotations

import copy

import pytest

from rollouts.errors import ConfigError, DataError
from training.data.accounting import DataIssue
from training.data.sft_data import SFTRecord
from training.data.tokenize import TokenizedSample, tokenize_conversation, tokenize_records

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "12*34"}}}
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "what is 2+3"},
    {"role": "assistant", "content": "the sum is 5"},
    {"role": "user", "content": "and 12*34"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "408", "tool_call_id": "c1"},
    {"role": "assistant", "content": "408"},
]
EXPECTED_SPANS = [
    "the sum is 5<|im_end|>",
    '<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call><|im_end|>',
    "408<|im_end|>",
]


def trained_spans(tokenizer, sample: TokenizedSample) -> list[str]:
    """Decode each maximal run of trained tokens."""
    spans: list[list[int]] = []
    previous = 0
    for token, trained in zip(sample.input_ids, sample.loss_mask, strict=True):
        if trained and not previous:
            spans.append([])
        if trained:
            spans[-1].append(token)
        previous = trained
    return [tokenizer.decode(span) for span in spans]


def with_template(tokenizer, template: str):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def test_multi_turn_masks_train_assistant_content_and_end_token_only(tiny_tokenizer):
    sample = tokenize_conversation(tiny_tokenizer, CONVERSATION, TOOLS, source="d.jsonl:3")
    full = tiny_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, return_dict=False)
    assert list(sample.input_ids) == full
    assert len(sample.loss_mask) == len(full)
    assert sample.source == "d.jsonl:3"
    assert trained_spans(tiny_tokenizer, sample) == EXPECTED_SPANS
    assert sample.n_trained == sum(len(tiny_tokenizer.encode(s)) for s in EXPECTED_SPANS)
    untrained = tiny_tokenizer.decode(
        [t for t, m in zip(full, sample.loss_mask, strict=True) if not m]
    )
    assert "Tools:" in untrained  # the tool schema in the system header is context
    for header in ("<|im_start|>system", "<|im_start|>user", "<|im_start|>assistant\n"):
        assert header in untrained
    assert "<|im_start|>tool\n408<|im_end|>" in untrained


def test_assistant_turn_with_weight_zero_is_context_only(tiny_tokenizer):
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["weight"] = 0
    sample = tokenize_conversation(tiny_tokenizer, messages, TOOLS)
    assert trained_spans(tiny_tokenizer, sample) == EXPECTED_SPANS[1:]


# No trailing newline, no system header, ":" instead of "\n" after the role.
COMPACT_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + ':' + m.content + '<|im_end|>' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant:' -}}{%- endif -%}"
)
# Qwen2.5-style: consecutive tool results are merged into ONE user turn, so the render of a
# conversation ending in the first of two tool messages is not a prefix of the next render.
MERGING_TOOLS_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<r>' + m.content + '</r>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_other_templates_get_masks_without_generation_markers(tiny_tokenizer):
    messages = [m for m in CONVERSATION if m["role"] in ("user", "assistant") and m["content"]]
    compact = with_template(tiny_tokenizer, COMPACT_TEMPLATE)
    sample = tokenize_conversation(compact, messages)
    assert trained_spans(compact, sample) == ["the sum is 5<|im_end|>", "408<|im_end|>"]

    merging = with_template(tiny_tokenizer, MERGING_TOOLS_TEMPLATE)
    messages = [
        {"role": "user", "content": "two calls"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "3"},
    ]
    sample = tokenize_conversation(merging, messages)
    assert trained_spans(merging, sample) == ["calling<|im_end|>", "3<|im_end|>"]
    assert "<r>1</r>\n<r>2</r><|im_end|>" in merging.decode(sample.input_ids)


# Adds an empty reasoning block only when prompting for generation (as Qwen3 does).
THINKING_PROMPT_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think></think>' -}}{%- endif -%}"
)


def test_generation_prompt_extras_missing_from_the_turn_are_not_trained(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, THINKING_PROMPT_TEMPLATE)
    sample = tokenize_conversation(tokenizer, CONVERSATION[1:3])
    assert trained_spans(tokenizer, sample) == ["the sum is 5<|im_end|>"]


# Writes the number of messages first, so every prefix renders differently from the next.
COUNTING_TEMPLATE = (
    "{{- messages | length -}}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Drops the content of every assistant turn but the last, as reasoning-stripping templates do.
HISTORY_REWRITING_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.role != 'assistant' or loop.last -%}{{- m.content -}}{%- endif -%}"
    "{{- '<|im_end|>' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.mark.parametrize("template", [COUNTING_TEMPLATE, HISTORY_REWRITING_TEMPLATE])
def test_template_violating_the_prefix_property_raises_naming_the_record(tiny_tokenizer, template):
    messages = [m for m in CONVERSATION if m["role"] in ("user", "assistant") and m["content"]]
    tokenizer = with_template(tiny_tokenizer, template)
    with pytest.raises(DataError, match=r"^data\.jsonl:7: the chat template is not prefix-stable"):
        tokenize_conversation(tokenizer, messages, source="data.jsonl:7")


def test_template_render_failure_raises_naming_the_record(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, "{{ raise_exception('no tools here') }}")
    with pytest.raises(DataError, match=r"^d\.jsonl:2: the chat template failed to render"):
        tokenize_conversation(tokenizer, CONVERSATION[:3], source="d.jsonl:2")


def records(*lengths: int) -> list[SFTRecord]:
    """Records whose user turn is `n` digits long, so their token counts differ by design."""
    return [
        SFTRecord(
            messages=(
                {"role": "user", "content": "1" * n},
                {"role": "assistant", "content": "42"},
            ),
            tools=None,
            source=f"d.jsonl:{i + 1}",
        )
        for i, n in enumerate(lengths)
    ]


def test_truncation_cuts_to_max_seq_len_and_counts_cut_tokens(tiny_tokenizer):
    full, stats = tokenize_records(records(5, 30, 60), tiny_tokenizer, max_seq_len=10_000)
    assert stats.n_truncated == stats.n_truncated_tokens == 0
    max_len = len(full[2]) - 2  # cuts "<|im_end|>\n" off the longest record's answer
    assert len(full[1]) <= max_len
    samples, stats = tokenize_records(records(5, 30, 60), tiny_tokenizer, max_seq_len=max_len)
    assert [len(s) for s in samples] == [len(full[0]), len(full[1]), max_len]
    assert samples[2].input_ids == full[2].input_ids[:max_len]
    assert samples[2].loss_mask == full[2].loss_mask[:max_len]
    assert 0 < samples[2].n_trained < full[2].n_trained
    assert (stats.n_records, stats.n_kept, stats.n_truncated) == (3, 3, 1)
    assert stats.n_truncated_tokens == len(full[2]) - max_len
    assert stats.n_tokens == sum(len(s) for s in samples)
    assert stats.n_trained_tokens == sum(s.n_trained for s in samples)
    assert "truncated 1" in stats.summary()


def test_a_record_cut_to_no_trained_token_is_counted_over_long_and_named(tiny_tokenizer):
    full, _ = tokenize_records(records(5, 60), tiny_tokenizer, max_seq_len=10_000)
    max_len = len(full[0]) + 1  # the long record's answer lies entirely beyond this
    assert full[1].loss_mask.index(1) >= max_len
    samples, stats = tokenize_records(records(5, 60), tiny_tokenizer, max_seq_len=max_len)
    assert [s.source for s in samples] == ["d.jsonl:1"]
    # over-long, so counted with the over-long records, not as "no trained tokens" alone
    assert (stats.n_kept, stats.n_truncated, stats.n_dropped_overlong) == (1, 0, 1)
    assert stats.n_dropped_empty == stats.n_truncated_tokens == 0
    assert stats.issues == (
        DataIssue("d.jsonl:2", len(full[1]), max_len, "no trained tokens left",
                  tokens_cut=len(full[1]) - max_len),
    )  # fmt: skip
    assert "dropped 1 over-long" in stats.summary()


def records_of_known_lengths(tokenizer, n: int) -> tuple[list[SFTRecord], list[tuple[int, int]]]:
    """`n` records of three shapes, with (tokens, index of the first trained token) of each:
    a short one, a long question with a one-token answer (cutting it removes the answer) and a
    short question with a long answer (cutting it keeps the answer's start)."""
    recs = []
    for i in range(n):
        shape = i % 3
        question, answer = ("1" * 4, "7") if shape == 0 else ("1" * (10 * i), "7")
        if shape == 2:
            question, answer = "1", "a " * (5 * i)
        recs.append(SFTRecord(({"role": "user", "content": question},
                               {"role": "assistant", "content": answer}), None, f"g.jsonl:{i + 1}"))  # fmt: skip
    whole = [tokenize_conversation(tokenizer, r.messages) for r in recs]
    return recs, [(len(s), s.loss_mask.index(1)) for s in whole]


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_every_cut_or_dropped_record_is_counted_and_named(tiny_tokenizer, overlong):
    recs, shapes = records_of_known_lengths(tiny_tokenizer, 45)
    limit = 200
    samples, stats = tokenize_records(recs, tiny_tokenizer, max_seq_len=limit, overlong=overlong)

    over = [i for i, (n, _) in enumerate(shapes) if n > limit]
    emptied = [i for i in over if shapes[i][1] >= limit]  # its first trained token is cut off
    keep_answer = [i for i in over if i not in emptied]
    assert len(keep_answer) >= 3 and len(emptied) >= 3  # the shapes above make both kinds
    cut = [] if overlong == "drop" else keep_answer
    dropped = over if overlong == "drop" else emptied
    assert stats.n_records == 45 and stats.n_kept == 45 - len(dropped) == len(samples)
    assert (stats.n_truncated, stats.n_dropped_overlong, stats.n_dropped_empty) == (
        len(cut), len(dropped), 0)  # fmt: skip
    assert stats.n_truncated_tokens == sum(shapes[i][0] - limit for i in cut)
    assert [(i.source, i.tokens, i.limit, i.tokens_cut) for i in stats.issues] == [
        (f"g.jsonl:{i + 1}", shapes[i][0], limit, shapes[i][0] - limit) for i in over
    ]
    what = {"truncate": "no trained tokens left", "drop": "dropped over-long"}[overlong]
    assert [i.what for i in stats.issues] == [
        "cut" if j in cut else what for j in over
    ]  # fmt: skip
    assert all(len(s) <= limit for s in samples)


def test_drop_mode_drops_and_counts_overlong_samples(tiny_tokenizer):
    full, _ = tokenize_records(records(5, 30, 60), tiny_tokenizer, max_seq_len=10_000)
    samples, stats = tokenize_records(
        records(5, 30, 60), tiny_tokenizer, max_seq_len=len(full[1]), overlong="drop"
    )
    assert [s.source for s in samples] == ["d.jsonl:1", "d.jsonl:2"]
    assert samples == full[:2]
    assert (stats.n_records, stats.n_kept, stats.n_dropped_overlong) == (3, 2, 1)
    assert stats.n_truncated == stats.n_truncated_tokens == 0
    assert stats.n_kept + stats.n_dropped_overlong + stats.n_dropped_empty == stats.n_records


def test_tokenize_records_reports_every_failing_record(tiny_tokenizer):
    tokenizer = with_template(tiny_tokenizer, COUNTING_TEMPLATE)
    with pytest.raises(DataError) as excinfo:
        tokenize_records(records(*range(12)), tokenizer, max_seq_len=100)
    message = str(excinfo.value)
    assert message.startswith("12 invalid record(s)")
    assert "d.jsonl:1: the chat template is not prefix-stable" in message
    assert message.endswith("... and 2 more")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_seq_len": 1}, "max_seq_len"), ({"max_seq_len": 8, "overlong": "cut"}, "overlong")],
)
def test_bad_settings_raise_config_error(tiny_tokenizer, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        tokenize_records(records(1), tiny_tokenizer, **kwargs)


def test_trained_assistant_turn_opening_the_conversation_is_refused(tiny_tokenizer):
    with pytest.raises(DataError, match=r"^x:1: messages\[0\]: a trained assistant turn cannot"):
        tokenize_conversation(tiny_tokenizer, CONVERSATION[2:3], source="x:1")


def test_first_token_is_never_marked_trained(tiny_tokenizer):
    only_assistant = (
        "{%- for m in messages if m.role == 'assistant' -%}{{ m.content }}{%- endfor -%}"
    )
    tokenizer = with_template(tiny_tokenizer, only_assistant)
    sample = tokenize_conversation(
        tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "123"}]
    )
    assert sample.input_ids == tuple(tokenizer.encode("123"))
    assert sample.loss_mask == (0, 1, 1)
    assert sample.n_trained == 2
