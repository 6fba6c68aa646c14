"""inspect_rollout shows what the trainer sees per token; validate_batch names every sample or
group that would train wrongly."""

from __future__ import annotations

import dataclasses
import math

from rollouts.debug import inspect_rollout, sample_line, shorten, validate_batch
from rollouts.types import RolloutBatch, Sample, ToolCallRecord


def sample(g=0, i=0, *, prompt=(1, 2), response=(5, 6), mask=(1, 1), logprobs=(-0.5, -1.0),
           reward=1.0, version=0, **kw) -> Sample:  # fmt: skip
    return Sample(prompt, response, mask, logprobs, reward=reward, group_id=g, index_in_group=i,
                  weight_version=version, **kw)  # fmt: skip


def test_inspect_rollout_lists_tokens_masks_logprobs_rewards_and_tool_calls(tiny_tokenizer):
    ids = tiny_tokenizer.encode("12", add_special_tokens=False)
    tool = ToolCallRecord("calc", {"expr": "3*4"}, "12", success=True, latency_s=0.01)
    s = Sample((1, 2), (*ids, 7), (1,) * len(ids) + (0,), (-0.25,) * len(ids) + (0.0,),
               reward=1.5, reward_components={"correct": 1.0, "format": 0.5},
               metadata={"answer": "12"}, tool_calls=(tool,), finish_reason="stop")  # fmt: skip
    text = inspect_rollout(s, tiny_tokenizer)
    assert "reward: 1.5 (correct=1 format=0.5)" in text
    assert "metadata: {'answer': '12'}" in text
    assert f"{len(ids) + 1} tokens, {len(ids)} trained" in text
    token_lines = [line.split() for line in text.splitlines() if line.split()[0].isdigit()]
    assert [t[:3] for t in token_lines] == [
        [str(i), str(id_), "1"] for i, id_ in enumerate(ids)
    ] + [
        [str(len(ids)), "7", "0"]  # the tool token: mask 0
    ]
    assert token_lines[0][3] == "-0.2500" and token_lines[0][4] == repr(
        tiny_tokenizer.decode(ids[:1])
    )
    assert "tool call 0: calc({'expr': '3*4'}) -> '12' [ok" in text
    short = inspect_rollout(s, None, max_tokens=1)
    assert f"... {len(ids)} more tokens" in short and "'" not in short.splitlines()[0]


def test_inspect_rollout_prints_what_it_returns(capsys, tiny_tokenizer):
    s = sample(response=(5, 6, 7), mask=(1, 1, 0), logprobs=(-0.5, -1.0, 0.0))
    text = inspect_rollout(s, tiny_tokenizer)
    assert capsys.readouterr().out == text + "\n" and "3 tokens, 2 trained" in text
    assert inspect_rollout(s, tiny_tokenizer, quiet=True) == text
    assert capsys.readouterr().out == ""


def test_sample_line_keeps_the_prompts_end_and_the_responses_start_on_one_line(tiny_tokenizer):
    assert shorten("abc\ndef", 20) == "abc⏎def"
    assert shorten("x" * 10 + "QUESTION", 8, keep="tail") == "…[10 chars]…QUESTION"
    assert shorten("ANSWER" + "y" * 50, 6) == "ANSWER…[50 chars]…"
    prompt = tiny_tokenizer.encode("a long preamble " * 30 + "what is 2+3?",
                                   add_special_tokens=False)  # fmt: skip
    s = Sample(tuple(prompt), (5, 6), (1, 1), (-0.5, -1.0), response_text="5\nbecause",
               reward=0.5, reward_components={"correct": 0.0, "digits": 0.5},
               status="truncated")  # fmt: skip
    line = sample_line(s, tiny_tokenizer, max_chars=40)
    assert "\n" not in line and "what is 2+3?' -> response '5⏎because' (2 tokens)" in line
    assert line.endswith("reward 0.5 (correct=0 digits=0.5) [truncated]"), line
    assert "prompt '…[" in line and len(line) < 200


def test_a_consistent_batch_has_no_problems():
    batch = RolloutBatch(((sample(0, 0), sample(0, 1)), (sample(1, 0), sample(1, 1))), 1, 0)
    report = validate_batch(batch)
    assert report.ok and report.problems == () and report.n_samples == 4


def test_validate_batch_reports_each_kind_of_problem():
    nan_reward = dataclasses.replace(sample(0, 1), reward=math.nan)
    groups = (
        (sample(0, 0), nan_reward),
        (sample(1, 0), sample(1, 1, prompt=(9,)), sample(1, 2)),  # wrong size, other prompt
        (sample(2, 0, response=(), mask=(), logprobs=()), sample(2, 1, logprobs=(0.5, -1.0))),
        (sample(3, 0, mask=(0, 0)), sample(3, 1, version=1, logprobs=())),
        (sample(4, 0, status="failed", error="engine 500"), sample(5, 1)),
    )
    report = validate_batch(RolloutBatch(groups, 1, 0))

    def has(severity, group, index, prefix) -> bool:
        return any((p.severity, p.group, p.index) == (severity, group, index)
                   and p.message.startswith(prefix) for p in report.problems)  # fmt: skip

    assert has("error", 0, 1, "reward is nan")
    assert has("error", 1, None, "3 samples, expected 2")
    assert has("error", 1, None, "samples have different prompts")
    assert has("warning", 2, 0, "empty response")
    assert has("error", 2, 1, "1 trained-token logprobs non-finite or > 0: [0.5]")
    assert has("warning", 3, 0, "no trained token (loss_mask all 0)")
    assert has("warning", 3, 1, "no engine logprobs")
    assert has("warning", 3, None, "mixed weight versions [0, 1]")
    assert has("warning", 4, 0, "status failed: engine 500")
    assert has("error", 4, None, "mixed group_ids [4, 5]")
    assert has("warning", None, None, "weight versions [0, 1] (off-policy samples)")
    assert not report.ok and len(report.errors) == 5 and len(report.warnings) == 6
    assert str(report).startswith("batch of 5 groups / 11 samples: 5 errors, 6 warnings")
    assert "error: group 0 sample 1: reward is nan" in str(report)


def test_validate_batch_checks_the_expected_group_size_and_empty_batches():
    batch = RolloutBatch(((sample(0, 0), sample(0, 1)),), 1, 0)
    assert validate_batch(batch).ok
    assert [str(p) for p in validate_batch(batch, group_size=4).errors] == [
        "error: group 0: 2 samples, expected 4"
    ]
    assert [str(p) for p in validate_batch(RolloutBatch((), 1, 0)).errors] == [
        "error: batch: no groups"
    ]
