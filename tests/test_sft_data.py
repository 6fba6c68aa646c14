"""The SFT JSONL loader: both formats accepted, every malformed line reported with file:line:field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollouts.errors import DataError
from training.data.sft_data import SFTRecord, load_sft_jsonl, validate_sft_record

CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
    ]
}
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
TOOL_CHAT = {
    "messages": [
        {"role": "user", "content": "12*34?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calc", "arguments": '{"expression": "12*34"}'},
                }
            ],
        },
        {"role": "tool", "content": "408", "tool_call_id": "c1", "name": "calc"},
        {"role": "assistant", "content": "408"},
    ],
    "tools": TOOLS,
}


def write_lines(path: Path, lines: list) -> Path:
    """Write objects as JSON lines (strings are written verbatim)."""
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def load_error(path: Path) -> str:
    with pytest.raises(DataError) as excinfo:
        load_sft_jsonl(path)
    return str(excinfo.value)


def test_both_formats_load_in_order_and_blank_lines_are_skipped(tmp_path: Path):
    path = write_lines(
        tmp_path / "d.jsonl",
        [CHAT, "", "   ", {"prompt": "hi", "completion": "hello"}, TOOL_CHAT, ""],
    )
    records = load_sft_jsonl(path)
    assert [r.source for r in records] == [f"{path}:1", f"{path}:4", f"{path}:5"]
    assert records[0] == SFTRecord(messages=tuple(CHAT["messages"]), tools=None, source=f"{path}:1")
    assert records[1].messages == (
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    )
    assert records[2].tools == tuple(TOOLS)


def test_tool_call_fields_are_kept_and_string_arguments_parsed(tmp_path: Path):
    (record,) = load_sft_jsonl(write_lines(tmp_path / "d.jsonl", [TOOL_CHAT]))
    call = record.messages[1]["tool_calls"][0]
    assert call["id"] == "c1"
    assert call["function"] == {"name": "calc", "arguments": {"expression": "12*34"}}
    assert record.messages[1]["content"] == ""  # null content beside tool calls
    assert record.messages[2]["tool_call_id"] == "c1"
    assert record.messages[2]["name"] == "calc"


def test_unknown_message_keys_pass_through_to_the_template():
    obj = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "think"},
        ]
    }
    record, problems = validate_sft_record(obj, "x:1")
    assert problems == []
    assert record.messages[1]["reasoning_content"] == "think"


def bad(messages, **extra):
    return {"messages": messages, **extra}


U = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"messages": [', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ({"text": "hi"}, "expected a 'messages' list or 'prompt' and 'completion' strings"),
        ({**CHAT, "prompt": "p", "completion": "c"}, "has both 'messages' and 'prompt'"),
        ({"messages": "hi"}, "messages: expected a list, got string"),
        (bad([]), "messages: empty conversation"),
        (bad([U]), "messages: no assistant turn to train on"),
        (bad([U, {**A, "weight": 0}]), "messages: every assistant turn has weight 0"),
        (bad([U, "hi"]), "messages[1]: expected an object, got string"),
        (bad([A, U, A]), "messages[0]: a trained assistant turn cannot open the conversation"),
        (
            bad([U, {"role": "bot", "content": "a"}]),
            "messages[1].role: unknown role 'bot' (expected one of system, user, assistant, tool)",
        ),
        (bad([{"content": "q"}, A]), "messages[0].role: missing"),
        (bad([{"role": 3, "content": "q"}, A]), "messages[0].role: expected a string, got number"),
        (bad([{"role": "user"}, A]), "messages[0].content: missing"),
        (bad([U, {"role": "assistant", "content": 5}]), "messages[1].content: expected a string"),
        (
            bad([{"role": "user", "content": [{"type": "text", "text": "q"}]}, A]),
            "messages[0].content: expected a string, got list (multimodal",
        ),
        (bad([U, {"role": "assistant", "content": None}]), "messages[1].content: expected a str"),
        (bad([U, {**A, "weight": 2}]), "messages[1].weight: expected 0 or 1, got 2"),
        (bad([{**U, "weight": 1}, A]), "messages[0].weight: only allowed on assistant messages"),
        (bad([{**U, "tool_calls": []}, A]), "messages[0].tool_calls: only allowed on assistant"),
        (
            bad([U, A, {"role": "tool", "content": "1", "tool_call_id": 7}]),
            "messages[2].tool_call_id: expected a string",
        ),
        (bad([U, {**A, "tool_calls": {"x": 1}}]), "messages[1].tool_calls: expected a list"),
        (
            bad([U, {**A, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]),
            "messages[1].tool_calls[0].function.arguments: invalid JSON string",
        ),
        (
            bad([U, {**A, "tool_calls": [{"function": {"arguments": {}}}]}]),
            "messages[1].tool_calls[0].function.name: expected a non-empty string",
        ),
        (bad([U, A], tools={"calc": 1}), "tools: expected a list, got object"),
        (bad([U, A], tools=[{"name": "calc"}]), "tools[0].function: expected an object"),
        ({"prompt": "p"}, "completion: missing"),
        ({"prompt": ["p"], "completion": "c"}, "prompt: expected a string, got list"),
    ],
)
def test_each_malformed_kind_names_file_line_and_field(tmp_path: Path, line, expected: str):
    path = write_lines(tmp_path / "data.jsonl", [CHAT, line])
    message = load_error(path)
    assert f"{path}:2: {expected}" in message


def test_all_errors_are_collected_and_the_first_ten_shown(tmp_path: Path):
    lines = []
    for i in range(15):
        lines += [CHAT, bad([U, {"role": f"bot{i}", "content": "a"}])]
    path = write_lines(tmp_path / "data.jsonl", lines)
    message = load_error(path)
    assert message.startswith(f"15 invalid record(s) in {path}:")
    shown = re.findall(r":(\d+): messages\[1\]\.role: unknown role 'bot(\d+)'", message)
    assert shown == [(str(2 * i + 2), str(i)) for i in range(10)]
    assert message.endswith("... and 5 more")


def test_several_problems_in_one_record_are_all_reported(tmp_path: Path):
    path = write_lines(
        tmp_path / "data.jsonl", [bad([{"role": "bot", "content": 1}, {"role": "assistant"}])]
    )
    message = load_error(path)
    assert f"{path}:1: messages[0].role: unknown role 'bot'" in message
    assert f"{path}:1: messages[0].content: expected a string, got number" in message
    assert f"{path}:1: messages[1].content: missing" in message


def test_invalid_utf8_byte_names_the_line(tmp_path: Path):
    path = tmp_path / "data.jsonl"
    good = json.dumps(CHAT).encode()
    path.write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "completion": "x"}\n' + good + b"\n")
    nested = json.dumps(bad([U, {"role": "assistant", "content": "caf@"}])).encode()
    path.write_bytes(path.read_bytes() + nested.replace(b"@", b"\xff") + b"\n\xff\n")
    message = load_error(path)
    assert f"{path}:2: prompt: invalid UTF-8 byte 0xe9 at byte 16" in message
    assert f"{path}:4: messages[1].content: invalid UTF-8 byte 0xff at byte" in message
    assert f"{path}:5: invalid UTF-8 byte 0xff at byte 1" in message
    assert message.startswith("3 invalid record(s)")


def test_utf8_content_and_byte_order_mark_are_accepted(tmp_path: Path):
    path = tmp_path / "data.jsonl"
    line = json.dumps({"prompt": "café ☕", "completion": "ok"}, ensure_ascii=False)
    path.write_bytes(b"\xef\xbb\xbf" + line.encode("utf-8") + b"\r\n")
    (record,) = load_sft_jsonl(path)
    assert record.messages[0]["content"] == "café ☕"


def test_a_file_without_records_is_an_error(tmp_path: Path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n  \n", encoding="utf-8")
    assert "no records" in load_error(path)


def test_a_bad_value_at_column_88_is_reported_at_column_88(tmp_path: Path):
    from rollouts.prompts import load_prompt_jsonl

    head, tail = (
        '{"messages": [{"role": "user", "content": "',
        '"}, {"role": "assistant", "content": ',
    )
    line = head + "2+2".ljust(87 - len(head) - len(tail)) + tail + "four}]}"
    assert line.index("four") == 87  # column 88, counting from 1 as editors do
    path = write_lines(tmp_path / "data.jsonl", [CHAT, line])
    assert f"{path}:2: invalid JSON: Expecting value (column 88)" in load_error(path)
    alone = write_lines(tmp_path / "prompts.jsonl", [line])  # the RL prompts loader too
    with pytest.raises(
        DataError, match=re.escape(f"{alone}:1: invalid JSON: Expecting value (column 88)")
    ):
        load_prompt_jsonl(alone, tokenizer=None)
    call = {"function": {"name": "calc", "arguments": '{"expression": 2*3}'}}
    nested = write_lines(tmp_path / "args.jsonl", [bad([U, {**A, "tool_calls": [call]}])])
    assert "invalid JSON string: Expecting ',' delimiter (column 17 of the string)" in (
        load_error(nested)
    )
