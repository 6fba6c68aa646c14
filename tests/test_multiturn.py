"""Multi-turn rollouts against the real local engine over loopback HTTP.

The tiny model is untrained, so it does not write tool calls by itself: the tests script the
*parser* (a `ToolParser` is an extension point) to read given calls from each turn. Everything
else is real: the engine samples every model token, tools run, tool turns are tokenized and
appended. A recording proxy that delegates to the real engine shows what was sent and sampled.
"""

from __future__ import annotations

import time

import pytest
import trio
from rl_helpers import Call, RecordingEngine

from rollouts.chat_turns import ChatTurns
from rollouts.envs import ToolEnv, env_reward, math_grader
from rollouts.generation import GenerateContext, GroupSource, collect_groups, keep_all
from rollouts.multiturn import MultiTurnConfig, multiturn_generate, run_episode
from rollouts.prompts import PromptItem, encode_prompt
from rollouts.tools import (
    ParsedToolCall,
    SandboxLimits,
    calculator_tool,
    parse_hermes_tool_calls,
    python_tool,
    tool_metrics,
    tool_specs,
)

CALC = ParsedToolCall("calculator", {"expression": "2*3"})


def scripted(*turns: list[ParsedToolCall]):
    """A parser that 'reads' the given calls from successive turns, then none."""
    remaining = list(turns)
    return lambda text: remaining.pop(0) if remaining else []


def make_prompt(tok, tools=()) -> PromptItem:
    messages = ({"role": "user", "content": "What is 2*3?"},)
    specs = tool_specs(tools) or None
    return PromptItem(tuple(encode_prompt(tok, list(messages), specs)), messages, {"answer": "6"})


def make_ctx(engine, tok, **sampling) -> GenerateContext:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # Turns of 2-6 tokens that end with the end-of-turn token (the eos is strongly favoured
    # once min_new_tokens is reached), so the episode goes on to the next turn.
    params = {"max_new_tokens": 6, "min_new_tokens": 2, "logit_bias": {str(eos): 9.0}}
    return GenerateContext(engine, {**params, **sampling}, trio.CapacityLimiter(4), "mt", 0, tok)


def sampled_spans(sample, calls: list[Call]) -> list[tuple[int, int]]:
    """[start, end) of each turn's sampled tokens in response_ids, from what the engine saw."""
    n_prompt = len(sample.prompt_ids)
    return [
        (len(c.input_ids) - n_prompt, len(c.input_ids) - n_prompt + len(c.result.output_ids))
        for c in calls
    ]


# ----- the appended segment, without an engine --------------------------------------------------


def test_appended_turns_tokenize_like_the_whole_conversation(tiny_tokenizer):
    """Incremental ids (prompt + sampled + appended) equal the template over all messages."""
    tok, chat = tiny_tokenizer, ChatTurns.from_tokenizer(tiny_tokenizer)
    specs = tool_specs([calculator_tool()])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    user = {"role": "user", "content": "What is 2*3?"}
    tool = {"role": "tool", "name": "calculator", "content": "6"}
    prompt = encode_prompt(tok, [user], specs)
    turn1 = [*tok.encode(call, add_special_tokens=False), eos]  # as if sampled, with its eos
    turn2 = tok.encode("It is 6.", add_special_tokens=False)  # stopped before the eos
    ids = [*prompt, *turn1, *chat.appended_ids(turn1, [tool], specs), *turn2]
    ids += chat.appended_ids(turn2, [{"role": "user", "content": "Sure?"}], specs)
    messages = [user, {"role": "assistant", "content": call}, tool,
                {"role": "assistant", "content": "It is 6."}, {"role": "user", "content": "Sure?"}]  # fmt: skip
    assert ids == encode_prompt(tok, messages, specs)
    assert chat.turn_close_ids == tuple(tok.encode("<|im_end|>\n", add_special_tokens=False))
    assert chat.decode_turn(turn1) == call  # tool-call tags kept, eos dropped


# ----- token in, token out ---------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["eos", "stop_token"])
async def test_tokens_are_exactly_what_the_engine_saw_and_sampled(local_engine, tiny_tokenizer,
                                                                  ending):  # fmt: skip
    """Also: loss mask 1 exactly on sampled tokens, 0 on tool tokens; logprobs line up."""
    _, engine = local_engine
    tok = tiny_tokenizer
    proxy = RecordingEngine(engine)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    sampling = {}
    if ending == "stop_token":  # every turn ends on a stop token that is not the eos
        sampling = {"stop_token_ids": [t for t in range(len(tok)) if t != eos],
                    "logit_bias": {str(eos): -100.0}, "min_new_tokens": 0}  # fmt: skip
    ctx = make_ctx(proxy, tok, **sampling)
    tools = [calculator_tool()]
    env = ToolEnv(make_prompt(tok, tools), tools, math_grader, scripted([CALC], [CALC, CALC]))
    chat = ChatTurns.from_tokenizer(tok)
    sample = await run_episode(env, ctx, chat, index=3, metadata={"answer": "6"})

    calls = proxy.calls
    assert len(calls) == 3 and sample.status == "completed"
    assert calls[0].input_ids == sample.prompt_ids
    full = sample.prompt_ids + sample.response_ids
    for call in calls:  # each request = the conversation so far, token for token
        assert full[: len(call.input_ids)] == call.input_ids
        assert full[len(call.input_ids) :][: len(call.result.output_ids)] == call.result.output_ids
    assert full == calls[-1].input_ids + calls[-1].result.output_ids

    spans = sampled_spans(sample, calls)
    sampled = {i for start, end in spans for i in range(start, end)}
    assert [int(i in sampled) for i in range(len(sample.response_ids))] == list(sample.loss_mask)
    assert sum(sample.loss_mask) == sum(len(c.result.output_ids) for c in calls)
    for (start, end), call in zip(spans, calls, strict=True):
        assert sample.rollout_logprobs[start:end] == call.result.output_logprobs
    assert all(
        sample.rollout_logprobs[i] == 0.0
        for i in range(len(sample.response_ids))
        if i not in sampled
    )

    # the tool turns are in the non-sampled tokens, and the model was shown them
    appended = tok.decode([t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True)
                           if not m], skip_special_tokens=False)  # fmt: skip
    assert appended.count("<|im_start|>tool\n6<|im_end|>") == 3
    assert appended.count("<|im_start|>assistant\n") == 2
    if ending == "stop_token":
        assert all(c.result.output_ids[-1] != eos for c in calls)
        assert appended.startswith("<|im_end|>\n")  # the close the model did not sample
    else:
        assert all(c.result.output_ids[-1] == eos for c in calls)
    assert [(r.name, r.output, r.success) for r in sample.tool_calls] == [
        ("calculator", "6", True)
    ] * 3
    assert sample.index_in_group == 3 and sample.metadata == {"answer": "6"}


async def test_malformed_tool_call_is_a_failed_result_the_model_sees(local_engine, tiny_tokenizer):
    _, engine = local_engine
    proxy = RecordingEngine(engine)
    bad = parse_hermes_tool_calls(
        '<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>'
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    )
    tools = [calculator_tool()]
    env = ToolEnv(make_prompt(tiny_tokenizer, tools), tools, math_grader, scripted(bad))
    sample = await run_episode(
        env, make_ctx(proxy, tiny_tokenizer), ChatTurns.from_tokenizer(tiny_tokenizer)
    )
    assert sample.status == "completed" and len(proxy.calls) == 2  # the rollout went on
    assert [r.success for r in sample.tool_calls] == [False, False]
    shown = tiny_tokenizer.decode(proxy.calls[1].input_ids, skip_special_tokens=False)
    assert "<|im_start|>tool\nError: tool call is not valid JSON" in shown
    assert "<|im_start|>tool\nError: unknown tool 'search' (available: calculator)" in shown


async def test_sandbox_escapes_fail_as_tool_results_and_the_engine_survives(
    local_engine, tiny_tokenizer
):
    server, engine = local_engine
    limits = SandboxLimits(timeout_s=2.0, cpu_s=2)
    snippets = [
        "__import__('os').system('echo hi')",
        f"import socket; socket.create_connection(('127.0.0.1', {server.url.rsplit(':', 1)[1]}))",
        "import os; os.kill(os.getppid(), 0)",
        "while True: pass",
        "x = bytearray(10**10)",
        "print('x' * 10**8)",
    ]
    calls = [ParsedToolCall("python", {"code": code}) for code in snippets]
    tools = [python_tool(limits)]
    env = ToolEnv(make_prompt(tiny_tokenizer, tools), tools, math_grader, scripted(calls),
                  max_calls_per_turn=len(calls), max_output_chars=100)  # fmt: skip
    started = time.perf_counter()
    sample = await run_episode(
        env, make_ctx(engine, tiny_tokenizer), ChatTurns.from_tokenizer(tiny_tokenizer)
    )
    assert time.perf_counter() - started < 30
    assert sample.status == "completed" and len(sample.tool_calls) == len(snippets)
    errors = [r.error for r in sample.tool_calls]
    assert not any(r.success for r in sample.tool_calls), errors
    assert errors[3].startswith("timed out") and errors[5].startswith("output limit exceeded")
    assert "hi" not in sample.tool_calls[0].output.splitlines()
    for record, event in zip(sample.tool_calls, ["os.system", "socket.", "os.kill"], strict=False):
        assert f"sandbox: {event}" in record.output and "is not allowed here" in record.output
    assert "MemoryError" in sample.tool_calls[4].output
    after = await engine.generate([1, 2, 3], {"max_new_tokens": 2})  # the server still answers
    assert len(after.output_ids) >= 1


# ----- limits, aborts, and the GenerateFn ------------------------------------------------------


async def test_max_turns_and_token_budget_end_the_episode_as_truncated(
    local_engine, tiny_tokenizer
):
    _, engine = local_engine
    tok = tiny_tokenizer
    tools = [calculator_tool()]
    always = lambda text: [CALC]  # noqa: E731 - never gives a final answer
    proxy = RecordingEngine(engine)
    env = ToolEnv(make_prompt(tok, tools), tools, math_grader, always)
    sample = await run_episode(env, make_ctx(proxy, tok), ChatTurns.from_tokenizer(tok),
                               config=MultiTurnConfig(max_turns=2))  # fmt: skip
    assert sample.status == "truncated" and len(proxy.calls) == 2
    assert sample.loss_mask[-1] == 1  # ends on the model's tokens, no unanswered tool turn
    assert len(sample.tool_calls) == 2

    proxy = RecordingEngine(engine)
    env = ToolEnv(make_prompt(tok, tools), tools, math_grader, always)
    budget = 40
    sample = await run_episode(env, make_ctx(proxy, tok, max_new_tokens=30, min_new_tokens=30),
                               ChatTurns.from_tokenizer(tok),
                               config=MultiTurnConfig(max_turns=10, max_response_tokens=budget))  # fmt: skip
    assert sample.status == "truncated" and len(sample.response_ids) <= budget
    assert len(proxy.calls[0].result.output_ids) == 30
    for call in proxy.calls:  # each turn's max_new_tokens was capped to the budget left
        used = len(call.input_ids) - len(sample.prompt_ids)
        assert len(call.result.output_ids) <= budget - used


async def test_an_aborted_request_ends_the_episode_as_aborted(local_engine, tiny_tokenizer):
    server, engine = local_engine
    scheduler = server.state.scheduler
    tok = tiny_tokenizer
    ctx = make_ctx(engine, tok, max_new_tokens=400, min_new_tokens=400)
    tools = [calculator_tool()]
    env = ToolEnv(make_prompt(tok, tools), tools, math_grader, lambda text: [])
    result = []

    async def episode():
        result.append(await run_episode(env, ctx, ChatTurns.from_tokenizer(tok), index=1))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(episode)
        while not ctx.in_flight:
            await trio.sleep(0.01)
        assert ctx.in_flight == {"mt-1-t0."}  # rids end with "." (never a prefix of another)
        # at the engine (an abort of a rid it has not seen yet does nothing); not a fixed
        # sleep: on a loaded machine the request may not have arrived after one
        with trio.fail_after(60):
            while not (scheduler.waiting or scheduler.running):
                await trio.sleep(0.005)
        await engine.abort("mt-1-t0.")
    (sample,) = result
    assert sample.status == "aborted" and sample.finish_reason == "abort"
    assert len(sample.response_ids) < 400 and set(sample.loss_mask) <= {1}
    assert not ctx.in_flight


async def test_multiturn_generate_plugs_into_collect_groups(local_engine, tiny_tokenizer):
    _, engine = local_engine
    tok = tiny_tokenizer
    tools = [calculator_tool()]
    prompt = make_prompt(tok, tools)

    def make_env(p: PromptItem) -> ToolEnv:
        return ToolEnv(p, tools, lambda text, meta: 1.0, scripted([CALC]))

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    result = await collect_groups(
        GroupSource(lambda: (prompt, [])),
        n_groups=1,
        n_samples=3,
        engine=engine,
        sampling_params={"max_new_tokens": 6, "min_new_tokens": 2, "logit_bias": {str(eos): 9.0}},
        reward_fn=env_reward,
        generate_fn=multiturn_generate(make_env, tokenizer=tok),
        group_filter=keep_all,
        limiter=trio.CapacityLimiter(4),
    )
    (group,) = result.accepted
    assert sorted(s.index_in_group for s in group) == [0, 1, 2]
    assert all(s.status == "completed" and s.reward == 1.0 for s in group)
    assert all(dict(s.reward_components) == {"correct": 1.0} for s in group)
    metrics = tool_metrics(group)
    assert metrics["tool_calls_per_sample"] == 1.0 and metrics["turns_per_sample"] == 2.0
    assert metrics["tool_success_rate"] == 1.0


# ----- extension points: parser, executor, stop condition ---------------------------------------


async def test_custom_parser_executor_and_stop_condition_are_called_and_change_the_episode(
    local_engine, tiny_tokenizer
):
    from rollouts.tools import Tool, ToolResult

    _, engine = local_engine
    tok = tiny_tokenizer
    seen_args: list[dict] = []

    async def echo(arguments) -> ToolResult:  # a custom executor
        seen_args.append(dict(arguments))
        return ToolResult(f"echo:{arguments['x']}")

    tools = [Tool("echo", "echo x", {"type": "object", "properties": {"x": {}}}, echo)]
    parsed: list[str] = []

    def parser(text: str):  # a custom parser: every turn calls echo
        parsed.append(text)
        return [ParsedToolCall("echo", {"x": len(parsed)})]

    def run(config: MultiTurnConfig):
        env = ToolEnv(make_prompt(tok, tools), tools, math_grader, parser)
        return run_episode(env, make_ctx(engine, tok), ChatTurns.from_tokenizer(tok),
                           config=config)  # fmt: skip

    sample = await run(MultiTurnConfig(max_turns=3))
    assert len(parsed) == 3 and seen_args == [{"x": 1}, {"x": 2}, {"x": 3}]
    assert [c.output for c in sample.tool_calls] == ["echo:1", "echo:2", "echo:3"]
    assert "echo:2" in tok.decode(sample.response_ids)
    assert sample.status == "truncated"  # no final answer within max_turns

    stops: list[int] = []

    def stop_after_first_tool_result(messages) -> bool:
        stops.append(len(messages))
        return True

    parsed.clear()
    seen_args.clear()
    stopped = await run(MultiTurnConfig(max_turns=3, stop_condition=stop_after_first_tool_result))
    assert stops and len(parsed) == 1 and stopped.status == "completed"
    assert len(stopped.tool_calls) == 1 and len(stopped.response_ids) < len(sample.response_ids)
