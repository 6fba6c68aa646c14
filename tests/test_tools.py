"""Tools without an engine: parsers, calculator, running calls, the Python sandbox, tool rewards."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import trio

from rollouts.tools import (
    CalculatorError,
    ParsedToolCall,
    SandboxLimits,
    Tool,
    ToolError,
    ToolResult,
    calculator_tool,
    count_model_turns,
    evaluate_arithmetic,
    execute_tool_call,
    execute_tool_calls,
    parse_hermes_tool_calls,
    parse_xml_tool_calls,
    python_tool,
    run_python,
    tool_metrics,
    tool_success_reward,
    tool_usage_reward,
    tools_by_name,
)
from rollouts.types import Sample, ToolCallRecord

# ----- parsers ---------------------------------------------------------------------------------


def test_hermes_parser_reads_every_call_in_order():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}'
        '</tool_call> and <tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}\n'
        '</tool_call><tool_call>{"name": "search", "parameters": {"q": "x"}}</tool_call>'
    )
    calls = parse_hermes_tool_calls(text)
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, None),
        ("python", {"code": "1"}, None),  # arguments given as a JSON string (OpenAI style)
        ("search", {"q": "x"}, None),  # Llama 3's "parameters"
    ]
    assert parse_hermes_tool_calls("The answer is 6.") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {bad}}</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', 'no "name"'),
        ('<tool_call>["calculator"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": "{x"}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {}}', "unterminated"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "longer than"),
    ],
)
def test_hermes_parser_flags_malformed_calls_instead_of_raising(text, message):
    (call,) = parse_hermes_tool_calls(text)
    assert call.error is not None and message in call.error


def test_xml_parser_reads_argument_elements_and_json_bodies():
    text = (
        '<tool_call name="calculator"><expression>2*3</expression></tool_call> then '
        "<tool_call name='python'><code>\nif 1 < 2:\n    print('<ok>')\n</code></tool_call>"
        '<tool_call name="calculator">{"expression": "7-1"}</tool_call>'
    )
    calls = parse_xml_tool_calls(text)
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, None),
        ("python", {"code": "if 1 < 2:\n    print('<ok>')"}, None),  # verbatim, no escaping
        ("calculator", {"expression": "7-1"}, None),
    ]


async def test_the_seeds_plain_text_tool_call_parses_and_runs_as_the_tools_one_argument():
    (call,) = parse_xml_tool_calls('<tool_call name="calculator">123 + 456</tool_call>')
    assert call.error is None and call.text == "123 + 456"
    record = await execute_tool_call(call, tools_by_name([calculator_tool()]))
    assert record.success and record.output == "579"
    assert dict(record.arguments) == {"expression": "123 + 456"}


async def test_a_plain_text_body_for_a_tool_of_several_arguments_is_a_failed_call():
    two = Tool("pair", "two args", {"type": "object", "properties": {"a": {}, "b": {}}}, _echo)
    (call,) = parse_xml_tool_calls('<tool_call name="pair">1 2</tool_call>')
    record = await execute_tool_call(call, tools_by_name([two]))
    assert not record.success and "a plain-text body fits a tool with one argument" in record.error


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call><expression>1</expression></tool_call>", "no name attribute"),
        (
            '<tool_call name="calculator"><expression>2</expression>*3</tool_call>',
            "expected <argument>value</argument>",
        ),
        ('<tool_call name="calculator">{"expression": </tool_call>', "not valid JSON"),
        ('<tool_call name="calculator"><expression>1</expression>', "unterminated"),
    ],
)
def test_xml_parser_flags_malformed_calls(text, message):
    (call,) = parse_xml_tool_calls(text)
    assert call.error is not None and message in call.error


# ----- calculator ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [("(12+3)*4-5/2", 57.5), ("-2**2", -4), ("7//2 + 7%3", 4), ("2**-1", 0.5), ("+-3", -3)],
)
def test_calculator_evaluates_plain_arithmetic(expression, value):
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os')",
        "__import__('os').system('echo hi')",
        "x + 1",
        "abs(-1)",
        "(1).real",
        "'a' * 3",
        "[1, 2]",
        "1 < 2",
        "1 << 2",
        "True + 1",
        "lambda: 1",
        "1; 2",
        "",
    ],
)
def test_calculator_rejects_anything_but_arithmetic(expression):
    with pytest.raises(CalculatorError):
        evaluate_arithmetic(expression)


@pytest.mark.parametrize(
    "expression",
    ["9**9**9", "(10**200)**200", "10**1000 * 10**1000 * 10**1000", "2.0**5000", "1" * 201, "1/0"],
)
def test_calculator_refuses_huge_or_invalid_work_at_once(expression):
    started = time.perf_counter()
    with pytest.raises(CalculatorError):
        evaluate_arithmetic(expression)
    assert time.perf_counter() - started < 0.5


async def test_calculator_tool_returns_value_or_failed_result():
    tools = tools_by_name([calculator_tool()])
    ok = await execute_tool_call(ParsedToolCall("calculator", {"expression": "(12+3)*4"}), tools)
    assert (ok.success, ok.output, ok.error) == (True, "60", None)
    bad = await execute_tool_call(
        ParsedToolCall("calculator", {"expression": "__import__('os')"}), tools
    )
    assert not bad.success and bad.output.startswith("Error: ") and "not allowed" in bad.output


# ----- running calls ---------------------------------------------------------------------------


def _tool(executor, timeout_s: float = 1.0) -> Tool:
    return Tool(
        "echo",
        "echo the text",
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        executor,
        timeout_s,
    )


async def _echo(arguments):
    return ToolResult(arguments["text"])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (ParsedToolCall("", raw="{bad", error="tool call is not valid JSON"), "not valid JSON"),
        (ParsedToolCall("nope", {}), "unknown tool 'nope' (available: echo)"),
        (ParsedToolCall("echo", {}), "missing required argument(s) ['text']"),
        (ParsedToolCall("echo", {"text": 3}), "must be of type string"),
    ],
)
async def test_bad_calls_become_failed_records_the_model_reads(call, message):
    record = await execute_tool_call(call, tools_by_name([_tool(_echo)]))
    assert not record.success
    assert message in record.error and record.output == f"Error: {record.error}"


async def test_executor_errors_and_timeouts_become_failed_records(autojump_clock):
    async def raises_tool_error(arguments):
        raise ToolError("the service said no")

    async def buggy(arguments):
        return {}["missing"]

    async def slow(arguments):
        await trio.sleep(100)
        return ToolResult("late")

    async def reports_failure(arguments):
        return ToolResult("partial output", success=False, error="exit code 2")

    call = ParsedToolCall("echo", {"text": "hi"})
    cases = [
        (raises_tool_error, "the service said no"),
        (buggy, "tool raised KeyError"),
        (slow, "echo timed out after 1.0 s"),
        (reports_failure, "exit code 2"),
    ]
    for executor, message in cases:
        record = await execute_tool_call(call, tools_by_name([_tool(executor)]))
        assert not record.success and message in record.error
    assert record.output == "partial output\nError: exit code 2"


async def test_long_outputs_are_truncated_and_extra_calls_are_not_run():
    async def long(arguments):
        return ToolResult("x" * 50)

    calls = [ParsedToolCall("echo", {"text": str(i)}) for i in range(3)]
    records = await execute_tool_calls(
        calls, tools_by_name([_tool(long)]), max_calls=2, max_output_chars=10
    )
    assert [r.success for r in records] == [True, True, False]
    assert records[0].output == "xxxxx\n[... 40 characters truncated ...]\nxxxxx"
    assert "at most 2 tool calls per turn" in records[2].error


# ----- python sandbox --------------------------------------------------------------------------

FAST = SandboxLimits(timeout_s=3.0, cpu_s=10)  # the wall clock fires first (CPU: tested below)


async def test_sandbox_runs_code_in_a_fresh_directory():
    result = await run_python("import os\nprint(sum(range(10)), sorted(os.listdir('.')))", FAST)
    assert result.success and result.output == "45 ['snippet.py']\n"


async def test_sandbox_refuses_processes_signals_sockets_and_ctypes():
    snippets = {
        "__import__('os').system('echo hi')": "os.system",
        "import subprocess; subprocess.run(['echo', 'hi'])": "subprocess.Popen",
        "import os; os.fork()": "os.fork",
        "import os; os.kill(os.getppid(), 0)": "os.kill",
        "import socket; socket.socket()": "socket.__new__",
        "import ctypes; ctypes.CDLL(None).system(b'echo hi')": "ctypes.dlopen",
    }
    for code, event in snippets.items():
        result = await run_python(code, FAST)
        assert not result.success and result.exit_code == 1
        assert f"PermissionError: sandbox: {event} is not allowed" in result.output
        assert "hi" not in result.output.splitlines()  # the command never ran


async def test_sandbox_network_namespace_has_only_a_down_loopback():
    limits = SandboxLimits(require_network_isolation=True)
    result = await run_python("print(open('/proc/net/dev').read())", limits)
    if result.failure(limits) == "the sandbox could not isolate the network":
        pytest.skip("this kernel refuses network namespaces")
    interfaces = [line.split(":")[0].strip() for line in result.output.splitlines()[2:] if line]
    assert result.success and interfaces == ["lo"]


@pytest.mark.parametrize(
    ("code", "failure"),
    [
        ("print(__import__('os').getpid(), flush=True)\nwhile True: pass", "timed out after 3.0 s"),
        ("x = bytearray(10**10)", "exit code 1"),
        ("print('x' * 10**8)", "output limit exceeded"),
    ],
)
async def test_sandbox_limits_end_in_a_failed_result_within_the_timeout(code, failure):
    started = time.perf_counter()
    result = await run_python(code, FAST)
    assert time.perf_counter() - started < FAST.timeout_s + 2.0
    assert not result.success and failure in result.failure(FAST)
    assert len(result.output.encode()) <= FAST.max_output_bytes
    if "getpid" in code:  # the killed process is gone and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(int(result.output.split()[0]), 0)
    if "bytearray" in code:
        assert "MemoryError" in result.output


async def test_sandbox_cpu_limit_kills_a_busy_loop_before_the_wall_clock():
    limits = SandboxLimits(timeout_s=20.0, cpu_s=1)
    result = await run_python("while True: pass", limits)
    assert not result.success and "CPU time limit" in result.failure(limits)


async def test_cancelling_a_run_kills_its_process():
    with trio.move_on_after(1.0):
        await run_python("while True: pass", SandboxLimits(timeout_s=30.0, cpu_s=30))
    # nothing left running from the sandbox's interpreter in our process group or as our child
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_sandbox_child(int(p))]


def _is_sandbox_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return int(fields[1]) == os.getpid() and b"snippet.py" in cmdline


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("python3", path="/usr/bin") is None,
    reason="needs root and a system interpreter another user can run",
)
async def test_sandbox_as_an_unprivileged_user_cannot_write_outside_its_directory(tmp_path):
    target = tmp_path / "owned_by_root.txt"
    target.write_text("keep")
    limits = SandboxLimits(user="nobody", python="/usr/bin/python3")
    result = await run_python(f"open({str(target)!r}, 'w').write('gone')", limits)
    assert not result.success and "PermissionError" in result.output
    assert target.read_text() == "keep"
    ok = await run_python("open('out.txt', 'w').write('mine'); print('wrote')", limits)
    assert ok.success and ok.output == "wrote\n"


async def test_python_tool_failure_shows_the_traceback_to_the_model():
    tools = tools_by_name([python_tool(FAST)])
    record = await execute_tool_call(ParsedToolCall("python", {"code": "print('a')\n1/0"}), tools)
    assert not record.success and record.error == "exit code 1"
    assert record.output.startswith("a\nTraceback") and "ZeroDivisionError" in record.output
    assert record.output.endswith("Error: exit code 1")


# ----- tool rewards and metrics ----------------------------------------------------------------


def _sample(calls: list[tuple[str, bool]], mask: tuple[int, ...]) -> Sample:
    records = [ToolCallRecord(n, {}, "out", ok, latency_s=0.5) for n, ok in calls]
    return Sample((1,), (5,) * len(mask), mask, tool_calls=records)


def test_tool_rewards_and_metrics_on_hand_made_samples():
    three_turns = _sample([("calculator", True), ("python", False)], (1, 1, 0, 0, 1, 0, 1))
    one_turn = _sample([], (1, 1, 1))
    malformed = _sample([("", False)], (1, 0, 1))
    assert [tool_usage_reward(s) for s in (three_turns, one_turn, malformed)] == [1.0, 0.0, 1.0]
    assert [tool_success_reward(s) for s in (three_turns, one_turn, malformed)] == [0.5, 0.0, 0.0]
    assert [count_model_turns(s) for s in (three_turns, one_turn, malformed)] == [3, 1, 2]
    assert tool_metrics([three_turns, one_turn, malformed]) == {
        "tool_calls_per_sample": 1.0,
        "tool_use_rate": pytest.approx(2 / 3),
        "tool_unique_names": 2.0,
        "turns_per_sample": 2.0,
        "tool_success_rate": pytest.approx(1 / 3),
        "tool_latency_mean_s": 0.5,
    }
    assert tool_metrics([one_turn]) == {
        "tool_calls_per_sample": 0.0,
        "tool_use_rate": 0.0,
        "tool_unique_names": 0.0,
        "turns_per_sample": 1.0,
    }
    assert tool_metrics([]) == {}
