"""The agent proxy against the real local engine over loopback HTTP, driven by the `openai` client.

The tiny model is untrained and writes no tool calls by itself, so, as in test_multiturn.py,
the tool-call *parser* (an extension point) is scripted; the engine samples every token, the
agent runs the calculator and sends its results back through the real `openai` client.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from rollouts.agent import AgentConfig, agent_generate, open_agent_proxy, python_harness
from rollouts.chat_turns import ChatTurns
from rollouts.envs import arithmetic_grader, env_reward, tool_env_factory
from rollouts.generation import GenerateContext
from rollouts.multiturn import MultiTurnConfig, multiturn_generate
from rollouts.prompts import PromptItem, encode_prompt
from rollouts.tools import ParsedToolCall, calculator_tool, execute_tool_call, tool_specs

openai = pytest.importorskip("openai")

TOOLS = [calculator_tool()]
SPECS = tool_specs(TOOLS)


def scripted(*expressions: str):
    """A parser that 'reads' one calculator call per turn for the given expressions, then none."""
    remaining = list(expressions)

    def parse(text: str) -> list[ParsedToolCall]:
        return [ParsedToolCall("calculator", {"expression": remaining.pop(0)})] if remaining else []

    return parse


def prompt_for(tok, a: int, b: int) -> PromptItem:
    messages = ({"role": "user", "content": f"{a}*{b}"},)
    return PromptItem(tuple(encode_prompt(tok, list(messages), SPECS)), messages,
                      {"answer": str(a * b)})  # fmt: skip


def greedy_ctx(engine, tok, prefix: str) -> GenerateContext:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # Greedy turns of 2-6 tokens ending with the end-of-turn token, so episodes go on.
    params = {"temperature": 0.0, "max_new_tokens": 6, "min_new_tokens": 2,
              "logit_bias": {str(eos): 9.0}}  # fmt: skip
    return GenerateContext(engine, params, trio.CapacityLimiter(4), prefix, 0, tok)


async def calculator_agent(client, task) -> float:
    """An agent written for the OpenAI API: call the calculator until the model answers."""
    messages = list(task["messages"])
    tools = {t.name: t for t in TOOLS}
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=SPECS)  # fmt: skip
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return arithmetic_grader(message.content or "", task["metadata"])
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            record = await execute_tool_call(ParsedToolCall(call.function.name, args), tools)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": record.output})
    return 0.0


async def test_proxy_and_builtin_multiturn_give_identical_tokens_masks_and_logprobs(
    local_engine, tiny_tokenizer
):
    """The issue's equivalence: greedy, tool task, same tasks -> the same trajectories."""
    _, engine = local_engine
    tok = tiny_tokenizer
    for a, b, script in [(4821, 397, ("4821*397",)), (123, 456, ("123*456", "1+1")), (7, 8, ())]:
        prompt = prompt_for(tok, a, b)
        builtin_fn = multiturn_generate(
            tool_env_factory(TOOLS, arithmetic_grader, parser=scripted(*script)),
            tokenizer=tok, config=MultiTurnConfig(max_turns=3),
        )  # fmt: skip
        # Each path starts from an empty prefix cache: a cached prefix changes logprobs in
        # the last float bits, and the first path would otherwise warm it for the second.
        await engine.flush_cache()
        (builtin,) = await builtin_fn(prompt, 1, greedy_ctx(engine, tok, "mt"))
        proxy_fn = agent_generate(python_harness(calculator_agent), tokenizer=tok,
                                  config=AgentConfig(timeout_s=60, parser=scripted(*script)))  # fmt: skip
        await engine.flush_cache()
        (agent,) = await proxy_fn(prompt, 1, greedy_ctx(engine, tok, "ag"))
        assert agent.status == builtin.status == "completed", agent.error
        assert agent.prompt_ids == builtin.prompt_ids
        assert agent.response_ids == builtin.response_ids
        assert agent.loss_mask == builtin.loss_mask
        assert agent.rollout_logprobs == builtin.rollout_logprobs
        assert agent.reward == builtin.reward
        assert [(c.name, c.output) for c in agent.tool_calls] == [
            (c.name, c.output) for c in builtin.tool_calls
        ]
        assert sum(1 for i, m in enumerate(builtin.loss_mask) if m and
                   (i == 0 or not builtin.loss_mask[i - 1])) == len(script) + 1  # fmt: skip


async def test_history_rewrite_starts_a_branch_and_extension_never_retokenizes(
    local_engine, tiny_tokenizer
):
    """A call that extends the last one appends the sampled ids as they are; one that edits
    history is a new branch rendered from its messages; wrong keys and bad bodies are refused."""
    _, engine = local_engine
    tok = tiny_tokenizer
    ctx = greedy_ctx(engine, tok, "br")
    user = {"role": "user", "content": "2*3"}
    async with open_agent_proxy(ChatTurns.from_tokenizer(tok), parser=scripted()) as proxy:
        session = proxy.open_session(ctx, 0)
        other = proxy.open_session(ctx, 1)
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                      max_retries=0) as client:  # fmt: skip
            assert [m.id async for m in client.models.list()] == ["policy"]
            first = await client.chat.completions.create(model="m", messages=[user])
            said = first.choices[0].message.content
            follow = [user, {"role": "assistant", "content": said},
                      {"role": "user", "content": "again"}]  # fmt: skip
            await client.chat.completions.create(model="m", messages=follow)
            rewritten = [user, {"role": "assistant", "content": "6"},
                         {"role": "user", "content": "again"}]  # fmt: skip
            stream = await client.chat.completions.create(model="m", messages=rewritten,
                                                          stream=True)  # fmt: skip
            chunks = [c async for c in stream]
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(model="m", messages=[{"role": "robot"}])
        async with openai.AsyncOpenAI(base_url=other.base_url, api_key=session.api_key,
                                      max_retries=0) as intruder:  # fmt: skip
            with pytest.raises(openai.AuthenticationError):
                await intruder.chat.completions.create(model="m", messages=[user])
    assert "messages[0].role" in str(bad.value)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    extended, branch = session.trajectory.branches
    assert other.trajectory.branches == [] and other.fault is None
    assert session.fault is not None and "messages[0].role" in session.fault
    # branch 1 holds two calls; the first answer's ids are the engine's, never re-encoded
    assert extended.n_calls == 2 and branch.n_calls == 1
    assert branch.prompt_ids == tuple(encode_prompt(tok, rewritten))
    full = [*extended.prompt_ids, *extended.ids]
    assert full[: len(encode_prompt(tok, [user]))] == encode_prompt(tok, [user])
    assert full[len(extended.prompt_ids) :][: len(extended.last_output)] != []
    # two sampled spans (mask 1, engine logprobs), the appended turn between them (mask 0, 0.0),
    # and a weight version per sampled span
    assert [(s[0], s[1]) for s in extended.spans] == _spans(extended.mask)
    assert len(extended.spans) == 2 and extended.mask[0] == 1
    assert all(lp == 0.0 for lp, m in zip(extended.logprobs, extended.mask, strict=True) if not m)
    assert all(lp < 0.0 for lp, m in zip(extended.logprobs, extended.mask, strict=True) if m)
    appended = tok.decode([t for t, m in zip(extended.ids, extended.mask, strict=True) if not m])
    assert appended.endswith("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")


def _spans(mask):
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            out.append((start, i))
            start = None
    return out


async def test_broken_harnesses_fail_their_sample_with_the_cause_and_the_group_goes_on(
    local_engine, tiny_tokenizer
):
    """Raise, time out, send a bad body, return no number, call nothing: each sample fails
    with its cause; the good ones in the same group complete."""
    _, engine = local_engine
    tok = tiny_tokenizer
    prompt = prompt_for(tok, 2, 3)

    async def agent(client, task):
        kind = task["kind"]
        if kind == "raise":
            raise RuntimeError("agent bug")
        if kind == "hang":
            await trio.sleep_forever()
        if kind == "bad_body":
            await client.chat.completions.create(model="m", messages=[{"role": "user",
                                                                       "content": 3}])  # fmt: skip
        if kind == "silent":
            return 1.0
        return await calculator_agent(client, task)

    kinds = ["raise", "hang", "bad_body", "silent", "good"]
    samples = []
    for kind in kinds:

        def harness(endpoint, task, kind=kind):
            return python_harness(agent)(endpoint, {**task, "kind": kind})

        # only the hang is meant to meet the deadline: the others get one that a loaded
        # machine cannot reach (the good one makes real model calls through the proxy)
        timeout_s = 2.0 if kind == "hang" else 60.0
        fn = agent_generate(harness, tokenizer=tok, config=AgentConfig(timeout_s=timeout_s))
        (sample,) = await fn(prompt, 1, greedy_ctx(engine, tok, f"f-{kind}"))
        samples.append(sample)
    by_kind = dict(zip(kinds, samples, strict=True))
    assert "RuntimeError: agent bug" in by_kind["raise"].error
    assert "timed out after 2 s" in by_kind["hang"].error
    assert "messages[0].content" in by_kind["bad_body"].error
    assert "made no model call" in by_kind["silent"].error
    assert all(by_kind[k].status == "failed" for k in kinds[:-1])
    assert by_kind["good"].status == "completed" and by_kind["good"].error is None
    assert env_reward(by_kind["good"])["total"] in (0.0, 1.0)


def test_two_calls_extending_one_branch_at_once_fork_it_with_the_shared_prefix(tiny_tokenizer):
    """An agent fanning out (two calls from the same history, in flight together) gets two
    branches, both starting with the same exact tokens; nothing is written into the other."""
    from rollouts.agent.trajectory import SessionTrajectory

    tok = tiny_tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    trajectory = SessionTrajectory(ChatTurns.from_tokenizer(tok))
    user = {"role": "user", "content": "2*3"}
    first = trajectory.plan([user], None)
    answer = {"role": "assistant", "content": "hm"}
    sampled = [*tok.encode("hm", add_special_tokens=False), eos]
    trajectory.record(first, [user], answer, sampled, [-0.5] * len(sampled), [(0, len(sampled), 7)],
                      "stop", None)  # fmt: skip
    asks = [[user, answer, {"role": "user", "content": q}] for q in ("a?", "b?")]
    plans = [trajectory.plan(m, None) for m in asks]  # both planned before either is recorded
    for plan, messages in zip(plans, asks, strict=True):
        assert plan.branch == 0
        trajectory.record(plan, messages, {"role": "assistant", "content": "x"}, [eos], [-1.0],
                          [(0, 1, 8)], "stop", None)  # fmt: skip
    a, b = trajectory.branches
    shared = len(first.input_ids) + len(sampled)
    assert [*a.prompt_ids, *a.ids][:shared] == [*b.prompt_ids, *b.ids][:shared]
    assert a.ids[: len(sampled)] == sampled and a.mask[: len(sampled)] == [1] * len(sampled)
    for branch, q in zip((a, b), ("a?", "b?"), strict=True):
        text = tok.decode(branch.ids)
        assert q in text and ("b?" if q == "a?" else "a?") not in text
        assert branch.spans == [(0, len(sampled), 7), (len(branch.ids) - 1, len(branch.ids), 8)]


async def test_a_session_refused_for_its_body_size_fails_instead_of_training_its_reward(
    local_engine, tiny_tokenizer
):
    """Issue 49: a call refused with 413 on its headers (a body over the proxy's limit) is the
    session's fault like any bad body: an agent that swallows the refusal and reports 1.0 gives
    a failed sample naming the 413, not a trained one with the agent's own reward."""
    from rollouts.agent import session_sample
    from rollouts.agent.harness import HarnessOutcome

    _, engine = local_engine
    tok = tiny_tokenizer
    prompt = prompt_for(tok, 2, 3)
    messages = [dict(m) for m in prompt.messages]
    async with open_agent_proxy(ChatTurns.from_tokenizer(tok)) as proxy:
        proxy.app.max_body_bytes = 4096
        session = proxy.open_session(greedy_ctx(engine, tok, "big"), 0)
        client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                    max_retries=0)  # fmt: skip
        async with client:
            await client.chat.completions.create(model="policy", messages=messages)
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model="policy", messages=[
                    *messages, {"role": "user", "content": "x" * 5000}])  # fmt: skip
    assert refused.value.status_code == 413
    sample = session_sample(session, prompt, HarnessOutcome(reward=1.0))
    assert sample.status == "failed" and "413" in sample.error and "4096 bytes" in sample.error


async def test_a_call_whose_session_closes_while_its_body_arrives_is_answered_not_open(
    tiny_tokenizer,
):
    """The headers' check finds the session open; it is closed (its harness timed out) while
    the body is still on its way: the call is answered 404 "not open", as any call of a closed
    session, not with a 500 and a logged traceback."""
    async with open_agent_proxy(ChatTurns.from_tokenizer(tiny_tokenizer)) as proxy:
        ctx = GenerateContext(None, {}, trio.CapacityLimiter(1), "closing", 0, tiny_tokenizer)
        session = proxy.open_session(ctx, 0)
        body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
        path = session.base_url.removeprefix(proxy.url) + "/chat/completions"
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
                f"{session.api_key}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
        answer = b""
        with trio.fail_after(30):
            async with await trio.open_tcp_stream(host, int(port)) as stream:
                await stream.send_all(head.encode())
                await trio.testing.wait_all_tasks_blocked()  # checked; the body is awaited
                proxy.close_session(session)
                await stream.send_all(body.encode())
                while b"\r\n" not in answer:
                    answer += await stream.receive_some()
    assert answer.startswith(b"HTTP/1.1 404"), answer
