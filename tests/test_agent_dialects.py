"""The agent proxy's Anthropic Messages and OpenAI Responses dialects, driven by the real
`anthropic` and `openai` clients against the local engine over loopback HTTP.

As in test_agent_proxy.py, the untrained tiny model writes no tool calls by itself, so the
tool-call parser (an extension point) is scripted; the engine samples every token, and the
agents send the calculator's results back as `tool_result` blocks / `function_call_output`
items. Each dialect's trajectory is pinned to the built-in multi-turn path's (same tokens,
masks and logprobs), so its translation to chat messages and back loses nothing.
"""

from __future__ import annotations

import json

import pytest
import trio

from rollouts.agent import AgentConfig, AgentEndpoint, agent_generate, open_agent_proxy
from rollouts.chat_turns import ChatTurns
from rollouts.envs import arithmetic_grader, tool_env_factory
from rollouts.multiturn import MultiTurnConfig, multiturn_generate
from rollouts.tools import ParsedToolCall, execute_tool_call
from tests.test_agent_proxy import SPECS, TOOLS, greedy_ctx, prompt_for, scripted

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

ANTHROPIC_TOOLS = [{"name": s["function"]["name"], "description": s["function"]["description"],
                    "input_schema": s["function"]["parameters"]} for s in SPECS]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", **s["function"]} for s in SPECS]


async def run_tool(name: str, args) -> str:
    record = await execute_tool_call(ParsedToolCall(name, dict(args)), {t.name: t for t in TOOLS})
    return record.output


async def anthropic_calculator(client, task, *, stream: bool) -> float:
    """An agent written for Anthropic's Messages API (tools, tool_use -> tool_result)."""
    messages = [dict(m) for m in task["messages"]]
    for _ in range(3):
        request = {"model": "policy", "max_tokens": 64, "messages": messages,
                   "tools": ANTHROPIC_TOOLS}  # fmt: skip
        if stream:
            async with client.messages.stream(**request) as events:
                reply = await events.get_final_message()
        else:
            reply = await client.messages.create(**request)
        messages.append({"role": "assistant", "content": reply.content})
        calls = [b for b in reply.content if b.type == "tool_use"]
        if not calls:
            text = "".join(b.text for b in reply.content if b.type == "text")
            return arithmetic_grader(text, task["metadata"])
        results = []
        for call in calls:
            output = await run_tool(call.name, call.input)
            results.append({"type": "tool_result", "tool_use_id": call.id,
                            "content": [{"type": "text", "text": output}]})  # fmt: skip
        messages.append({"role": "user", "content": results})
    return 0.0


async def responses_calculator(client, task, *, stream: bool, chain: bool) -> float:
    """An agent written for OpenAI's Responses API: function tools, function_call_output; each
    later call sends only its new items with `previous_response_id` (`chain`), or all items."""
    request = {"model": "policy", "input": [dict(m) for m in task["messages"]],
               "tools": RESPONSES_TOOLS}  # fmt: skip
    for _ in range(3):
        if stream:
            events = [e async for e in await client.responses.create(stream=True, **request)]
            assert events[0].type == "response.created"
            reply = events[-1].response
        else:
            reply = await client.responses.create(**request)
        calls = [item for item in reply.output if item.type == "function_call"]
        if not calls:
            return arithmetic_grader(reply.output_text, task["metadata"])
        outputs = [{"type": "function_call_output", "call_id": c.call_id,
                    "output": await run_tool(c.name, json.loads(c.arguments))} for c in calls]  # fmt: skip
        if chain:
            request = {**request, "previous_response_id": reply.id, "input": outputs}
        else:
            request = {**request, "input": [*request["input"], *reply.output, *outputs]}
    return 0.0


def test_messages_translate_to_the_chat_turns_the_template_renders():
    """system blocks, text + tool_use, tool_result (text blocks, is_error) in order, tools."""
    from rollouts.agent.anthropic_dialect import read_messages_request

    req = read_messages_request({
        "model": "m", "max_tokens": 9, "stop_sequences": ["END"],
        "system": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "be right"}],
        "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": "2*3 and 4/0"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me compute."},
                {"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "2*3"}},
                {"type": "tool_use", "id": "t2", "name": "calculator", "input": {"expression": "4/0"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "6"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "division by zero",
                 "is_error": True},
                {"type": "text", "text": "and now?"}]},
        ],
    })  # fmt: skip
    calls = [{"id": f"t{i}", "type": "function", "function": {"name": "calculator",
              "arguments": {"expression": e}}} for i, e in ((1, "2*3"), (2, "4/0"))]  # fmt: skip
    assert list(req.messages) == [
        {"role": "system", "content": "be brief\nbe right"},
        {"role": "user", "content": "2*3 and 4/0"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "t1", "content": "6"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: division by zero"},
        {"role": "user", "content": "and now?"},
    ]
    assert list(req.tools) == SPECS and req.parse_tools and req.stop == ("END",)
    assert req.max_tokens == 9 and not req.stream


def test_responses_items_translate_to_chat_turns_and_chain_on_previous_responses():
    """function_call items join the assistant message before them; previous_response_id puts
    the stored conversation first; instructions lead but are not stored."""
    from rollouts.agent.responses_dialect import read_responses_request

    stored = ({"role": "user", "content": "2*3"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type":
               "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}]})  # fmt: skip
    req = read_responses_request({
        "model": "m", "instructions": "be brief", "previous_response_id": "resp_1",
        "input": [
            {"type": "function_call_output", "call_id": "c1", "output": "6"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "6, and", "annotations": []}]},
            {"type": "function_call", "call_id": "c2", "name": "calculator",
             "arguments": '{"expression": "1+1"}', "id": "fc_2", "status": "completed"},
            {"type": "function_call_output", "call_id": "c2", "output": "2"},
            {"role": "user", "content": [{"type": "input_text", "text": "sum?"}]},
        ],
    }, {"resp_1": stored}.get)  # fmt: skip
    c2 = {"id": "c2", "type": "function", "function": {"name": "calculator",
                                                       "arguments": {"expression": "1+1"}}}  # fmt: skip
    conversation = [*stored, {"role": "tool", "tool_call_id": "c1", "content": "6"},
                    {"role": "assistant", "content": "6, and", "tool_calls": [c2]},
                    {"role": "tool", "tool_call_id": "c2", "content": "2"},
                    {"role": "user", "content": "sum?"}]  # fmt: skip
    assert list(req.chat.messages) == [{"role": "system", "content": "be brief"}, *conversation]
    assert list(req.history) == conversation and req.store
    assert req.previous_response_id == "resp_1" and req.chat.tools is None


def anthropic_harness(stream: bool):
    async def run(endpoint, task):
        async with anthropic.AsyncAnthropic(base_url=endpoint.anthropic_base_url,
                                            api_key=endpoint.api_key, max_retries=0) as client:  # fmt: skip
            return await anthropic_calculator(client, task, stream=stream)

    return run


def responses_harness(stream: bool, chain: bool):
    async def run(endpoint, task):
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                                      max_retries=0) as client:  # fmt: skip
            return await responses_calculator(client, task, stream=stream, chain=chain)

    return run


DIALECTS = {
    "messages": anthropic_harness(stream=False),
    "messages-stream": anthropic_harness(stream=True),
    "responses-chained": responses_harness(stream=False, chain=True),
    "responses-stream-full-input": responses_harness(stream=True, chain=False),
}


async def test_each_dialect_gives_the_builtin_paths_tokens_masks_and_logprobs(
    local_engine, tiny_tokenizer
):
    """Greedy, tool task, two tool calls then an answer: every dialect's sample is the built-in
    multi-turn sample, token for token (one trajectory: each call extended the last)."""
    _, engine = local_engine
    tok = tiny_tokenizer
    prompt, script = prompt_for(tok, 123, 456), ("123*456", "1+1")
    builtin_fn = multiturn_generate(
        tool_env_factory(TOOLS, arithmetic_grader, parser=scripted(*script)),
        tokenizer=tok, config=MultiTurnConfig(max_turns=3),
    )  # fmt: skip
    await engine.flush_cache()  # each path from an empty prefix cache (test_agent_proxy.py)
    (builtin,) = await builtin_fn(prompt, 1, greedy_ctx(engine, tok, "mt"))
    assert [c.output for c in builtin.tool_calls] == ["56088", "2"]
    for name, harness in DIALECTS.items():
        fn = agent_generate(harness, tokenizer=tok,
                            config=AgentConfig(timeout_s=60, parser=scripted(*script)))  # fmt: skip
        await engine.flush_cache()
        (agent,) = await fn(prompt, 1, greedy_ctx(engine, tok, name))
        assert agent.status == builtin.status == "completed", (name, agent.error)
        assert agent.metadata["agent_branches"] == 1 and agent.metadata["agent_calls"] == 3, name
        assert agent.prompt_ids == builtin.prompt_ids, name
        assert agent.response_ids == builtin.response_ids, name
        assert agent.loss_mask == builtin.loss_mask, name
        assert agent.rollout_logprobs == builtin.rollout_logprobs, name
        assert agent.reward == builtin.reward, name
        assert [(c.name, c.output) for c in agent.tool_calls] == [
            (c.name, c.output) for c in builtin.tool_calls
        ], name


async def test_bad_requests_get_their_dialects_error_and_every_session_goes_on(
    local_engine, tiny_tokenizer
):
    """Malformed blocks, a tool_result or function_call_output for no call, another session's
    previous_response_id, a prompt past the context: each is a 4xx in its API's error shape
    (the SDK raises its own BadRequestError), the first is the session's fault, and the same
    session's next good call is answered, as is every other session's."""
    _, engine = local_engine
    tok = tiny_tokenizer
    user = {"role": "user", "content": "2*3"}
    long = {"role": "user", "content": " word" * 3000}
    async with open_agent_proxy(ChatTurns.from_tokenizer(tok), parser=scripted()) as proxy:
        a_session, r_session, other = (proxy.open_session(greedy_ctx(engine, tok, f"e{i}"), i)
                                       for i in range(3))  # fmt: skip
        a_url = AgentEndpoint(a_session.base_url, a_session.api_key).anthropic_base_url
        a_client = anthropic.AsyncAnthropic(base_url=a_url, api_key=a_session.api_key,
                                            max_retries=0)  # fmt: skip
        r_client = openai.AsyncOpenAI(base_url=r_session.base_url, api_key=r_session.api_key,
                                      max_retries=0)  # fmt: skip
        o_client = openai.AsyncOpenAI(base_url=other.base_url, api_key=other.api_key,
                                      max_retries=0)  # fmt: skip
        async with a_client, r_client, o_client:
            foreign = await o_client.responses.create(model="m", input="hello")
            bad_messages = {
                "image block": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                "unknown tool_use_id": [user, {"role": "assistant", "content": "ok"},
                                        {"role": "user", "content": [{"type": "tool_result",
                                         "tool_use_id": "toolu_nowhere", "content": "6"}]}],
                "past the context": [long],
            }  # fmt: skip
            a_errors = {}
            for case, messages in bad_messages.items():
                with pytest.raises(anthropic.BadRequestError) as raised:
                    await a_client.messages.create(model="m", max_tokens=8, messages=messages)
                a_errors[case] = raised.value
                good = await a_client.messages.create(model="m", max_tokens=8, messages=[user])
                assert good.type == "message" and good.stop_reason in ("end_turn", "max_tokens")
            stream = await a_client.messages.create(model="m", max_tokens=8, messages=[user],
                                                    stream=True)  # fmt: skip
            a_events = [event.type async for event in stream]
            stream = await r_client.responses.create(model="m", input="hi", stream=True)
            r_events = [event.type async for event in stream]
            bad_inputs = {
                "foreign previous_response_id": {"input": "again",
                                                 "previous_response_id": foreign.id},
                "unknown call_id": {"input": [user, {"type": "function_call_output",
                                                     "call_id": "call_nowhere", "output": "6"}]},
                "malformed item": {"input": [{"type": "input_image", "image_url": "x"}]},
                "past the context": {"input": [long]},
            }  # fmt: skip
            r_errors = {}
            for case, body in bad_inputs.items():
                with pytest.raises(openai.BadRequestError) as raised:
                    await r_client.responses.create(model="m", **body)
                r_errors[case] = raised.value
                good = await r_client.responses.create(model="m", input=[user])
                assert good.object == "response" and good.status in ("completed", "incomplete")
            again = await o_client.responses.create(model="m", input="more",
                                                    previous_response_id=foreign.id)  # fmt: skip
            with pytest.raises(anthropic.NotFoundError) as wrong_url:  # the OpenAI base URL
                await anthropic.AsyncAnthropic(
                    base_url=a_session.base_url, api_key=a_session.api_key, max_retries=0
                ).messages.create(model="m", max_tokens=8, messages=[user])
            with pytest.raises(anthropic.AuthenticationError) as intruder:
                await anthropic.AsyncAnthropic(
                    base_url=a_client.base_url, api_key=other.api_key, max_retries=0
                ).messages.create(model="m", max_tokens=8, messages=[user])
    for case, exc in a_errors.items():
        assert exc.status_code == 400, case
        assert exc.body["type"] == "error", case
        assert exc.body["error"]["type"] == "invalid_request_error", case
    assert "messages[0].content[0].type" in a_errors["image block"].body["error"]["message"]
    assert "messages[2].content[0].tool_use_id" in str(a_errors["unknown tool_use_id"])
    assert "context length" in str(a_errors["past the context"])
    assert intruder.value.status_code == 401 and intruder.value.body["type"] == "error"
    assert wrong_url.value.body["error"]["type"] == "not_found_error"
    assert "without /v1, AgentEndpoint.anthropic_base_url" in str(wrong_url.value)
    assert a_events == ["message_start", "content_block_start", "content_block_delta",
                        "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert r_events[:2] == ["response.created", "response.in_progress"]
    assert r_events[-1] in ("response.completed", "response.incomplete")
    for case, exc in r_errors.items():
        assert exc.status_code == 400 and exc.type == "invalid_request_error", case
    assert r_errors["foreign previous_response_id"].code == "previous_response_not_found"
    assert r_errors["foreign previous_response_id"].param == "previous_response_id"
    assert r_errors["unknown call_id"].param == "input[1].call_id"
    assert r_errors["malformed item"].param == "input[0].type"
    assert "context length" in str(r_errors["past the context"])
    # each session's first bad request is its fault (its sample fails); the other's is clean,
    # and its previous_response_id chained onto its own stored response
    assert "messages[0].content[0].type" in a_session.fault
    assert "previous_response_id" in r_session.fault
    assert other.fault is None and again.previous_response_id == foreign.id
    assert len(other.trajectory.branches) == 1 and other.trajectory.branches[0].n_calls == 2
    assert a_session.n_calls == 5 and r_session.n_calls == 6  # good calls + one past the context


def sampled_spans(sample) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """(ids, logprobs) of each run of loss-mask 1 in a sample's response: one per model turn."""
    spans, start = [], None
    for i, m in enumerate([*sample.loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((tuple(sample.response_ids[start:i]),
                          tuple(sample.rollout_logprobs[start:i])))  # fmt: skip
            start = None
    return spans


PROGRAMS = ["calculator_agent_anthropic.py", "calculator_agent_responses.py"]


@pytest.mark.parametrize("program", PROGRAMS)
async def test_sdk_program_agents_train_on_exactly_the_tokens_the_engine_sampled(
    local_engine, tiny_model_dir, tmp_path, program
):
    """Each example agent, a program using only its SDK (streamed, with its tool schema), trains
    2 RL steps of the tool task (configs/agent_tiny.yaml) with no failed sample; every sampled
    span of every trained sample in the rollout dump is, id for id and logprob for logprob, an
    answer the engine gave (recorded between the pool and the engine)."""
    import sys

    from engines.testing.fault_proxy import FaultPlan, FaultProxy
    from tests.distributed_launch import ROOT
    from training.config import load_config
    from training.recipes.rl import run_rl_recipe
    from training.rl.dump_audit import read_dump_lines
    from training.rl_config import RLRunConfig

    server, _ = local_engine
    sampled: set[tuple[tuple[int, ...], tuple[float, ...]]] = set()

    def record(path: str, body: bytes, answer: bytes) -> None:
        if path == "/generate":
            out = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            lps = tuple(lp for lp, *_ in out["meta_info"]["output_token_logprobs"])
            sampled.add((tuple(out["output_ids"]), lps))

    recorder = FaultProxy(server.url, FaultPlan())
    recorder.on_answer = record
    argv = json.dumps([sys.executable, str(ROOT / "examples" / program), "--stream", "--tools"])
    config = load_config(RLRunConfig, ROOT / "configs" / "agent_tiny.yaml", [
        f"output_dir={tmp_path / 'out'}", f"model.path={tiny_model_dir}",
        f"data.task_dir={tmp_path / 'data'}", "data.multiply.n_sft=4", "data.multiply.n_rl=16",
        "data.multiply.n_eval=4", "rollout.batch_size=1", "rollout.n_samples_per_prompt=2",
        "rollout.filter_groups=none", "rollout.sampling.max_new_tokens=8", "train.max_steps=2",
        "train.eval_samples=0", "train.dump_rollouts=true", f"agent.command={argv}",
    ])  # fmt: skip
    async with trio.open_nursery() as nursery:
        url = await nursery.start(recorder.serve)
        config = config.model_copy(update={"engines": config.engines.model_copy(
            update={"urls": [url]})})  # fmt: skip
        summary = await run_rl_recipe(config)
        nursery.cancel_scope.cancel()
    rows = [json.loads(r) for r in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert summary.steps == 2 and [r["weight_version"] for r in rows] == [1, 2]
    assert all(r["samples_failed"] == 0 for r in rows), rows
    lines = read_dump_lines(tmp_path / "out" / "rollouts.jsonl")
    samples = [s for _, batch in lines for group in batch.groups for s in group]
    assert [step for step, _ in lines] == [1, 2] and len(samples) >= 4
    spans = [span for s in samples for span in sampled_spans(s)]
    assert all(s.status in ("completed", "truncated") for s in samples)
    assert len(spans) >= len(samples) and all(span in sampled for span in spans)
