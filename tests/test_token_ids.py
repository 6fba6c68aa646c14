"""Token ids and tool calls on the OpenAI routes, as vLLM answers `return_token_ids: true`.

The agent proxy and `rollouts serve`'s `/v1` routes, driven by the real `openai` client
(`extra_body={"return_token_ids": True}`): the prompt's ids are what the engine was sent and
the returned ids what it sampled (the native `/generate` ids for the same request, and the
ids that decode to the returned text). The local engine's chat route returns a tool call as
`tool_calls` with `finish_reason: "tool_calls"`, streamed too.
"""

from __future__ import annotations

import pytest

from rollouts.agent import open_agent_proxy
from rollouts.chat_turns import ChatTurns
from rollouts.prompts import encode_prompt
from rollouts.tools import ParsedToolCall
from tests.test_agent_proxy import SPECS, greedy_ctx, scripted
from tests.test_thinking_branches import RecordingEngine

openai = pytest.importorskip("openai")

USER = {"role": "user", "content": "2*3"}
IDS = {"return_token_ids": True}
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
SEEN: list[str] = []  # the texts `calculator_everywhere` was given


def calculator_everywhere(text: str) -> list[ParsedToolCall]:
    """A `--tool-call-parser module:function` that reads a calculator call from any text (the
    tiny model is untrained and writes none by itself)."""
    SEEN.append(text)
    return [ParsedToolCall("calculator", {"expression": "2*3"})]


def extra(obj, key):
    return (obj.model_extra or {}).get(key)


async def test_proxy_returns_the_trajectorys_prompt_and_sampled_ids(local_engine, tiny_tokenizer):
    _, engine = local_engine
    tok, recording = tiny_tokenizer, RecordingEngine(engine)
    chat = ChatTurns.from_tokenizer(tok)
    async with open_agent_proxy(chat, parser=scripted("2*3")) as proxy:
        session = proxy.open_session(greedy_ctx(recording, tok, "ti"), 0)
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                      max_retries=0) as client:  # fmt: skip
            first = await client.chat.completions.create(model="m", messages=[USER], tools=SPECS,
                                                         extra_body=IDS)  # fmt: skip
            message = first.choices[0].message
            messages = [USER, message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "6"}]  # fmt: skip
            stream = await client.chat.completions.create(
                model="m", messages=messages, tools=SPECS, stream=True, extra_body=IDS
            )
            chunks = [c async for c in stream]
            plain = await client.chat.completions.create(model="m", messages=[USER])
    calls = recording.calls
    assert extra(first, "prompt_token_ids") == list(calls[0].input_ids)
    assert extra(first.choices[0], "token_ids") == list(calls[0].result.output_ids)
    assert first.choices[0].finish_reason == "tool_calls"
    assert chat.decode_turn(extra(first.choices[0], "token_ids")).strip() == message.content
    # streamed: the prompt's ids on the first chunk, the sampled ones summed over the chunks
    assert extra(chunks[0], "prompt_token_ids") == list(calls[1].input_ids)
    assert all(extra(c, "prompt_token_ids") is None for c in chunks[1:])
    streamed = [t for c in chunks for t in extra(c.choices[0], "token_ids")]
    assert streamed == list(calls[1].result.output_ids)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chat.decode_turn(streamed) == text
    # the ids are the trajectory's: the second call extends the first, token for token
    (branch, *_) = session.trajectory.branches
    assert branch.prompt_ids == tuple(extra(first, "prompt_token_ids"))
    assert (
        list(branch.prompt_ids + tuple(branch.ids))
        == extra(chunks[0], "prompt_token_ids") + streamed
    )
    assert extra(plain, "prompt_token_ids") is None and extra(plain.choices[0], "token_ids") is None


async def test_serve_v1_routes_return_the_ids_native_generate_samples(local_engine, tiny_tokenizer):
    server, engine = local_engine
    tok = tiny_tokenizer
    prompt = encode_prompt(tok, [USER])
    await engine.flush_cache()
    native = await engine.generate(prompt, GREEDY)
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="x", max_retries=0
    ) as client:
        await engine.flush_cache()
        reply = await client.chat.completions.create(
            model="m", messages=[USER], temperature=0, max_tokens=8, extra_body=IDS
        )
        await engine.flush_cache()
        stream = await client.chat.completions.create(
            model="m", messages=[USER], temperature=0, max_tokens=8, stream=True, extra_body=IDS
        )
        chunks = [c async for c in stream]
        await engine.flush_cache()
        done = await client.completions.create(model="m", prompt=prompt, temperature=0,
                                               max_tokens=8, extra_body=IDS)  # fmt: skip
        plain = await client.chat.completions.create(model="m", messages=[USER], max_tokens=2)
    choice = reply.choices[0]
    assert extra(reply, "prompt_token_ids") == prompt  # the chat template, as the engine saw it
    assert extra(choice, "token_ids") == list(native.output_ids)
    assert (
        tok.decode(extra(choice, "token_ids"), skip_special_tokens=True) == choice.message.content
    )
    assert extra(chunks[0], "prompt_token_ids") == prompt
    assert [t for c in chunks for ch in c.choices for t in extra(ch, "token_ids")] == list(
        native.output_ids
    )
    completion = done.choices[0]
    assert extra(completion, "prompt_token_ids") == prompt
    assert extra(completion, "token_ids") == list(native.output_ids)
    assert tok.decode(extra(completion, "token_ids"), skip_special_tokens=True) == completion.text
    assert extra(plain, "prompt_token_ids") is None and extra(plain.choices[0], "token_ids") is None


async def test_serve_chat_returns_tool_calls_not_text_streamed_or_not(
    tiny_model_dir, tiny_tokenizer
):
    from engines.local import open_local_engine

    parser = f"{__name__}:calculator_everywhere"
    async with (
        open_local_engine(tiny_model_dir, num_threads=1, tool_call_parser=parser) as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client,
    ):
        args = dict(model="m", messages=[USER], tools=SPECS, temperature=0, max_tokens=8,
                    extra_body=IDS)  # fmt: skip
        SEEN.clear()
        reply = await client.chat.completions.create(**args)
        chunks = [c async for c in await client.chat.completions.create(**args, stream=True)]
        refused = await client.chat.completions.create(**{**args, "tool_choice": "none"})
        no_tools = await client.chat.completions.create(
            model="m", messages=[USER], temperature=0, max_tokens=8
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    ((call,),) = [choice.message.tool_calls]
    assert (call.type, call.function.name, call.function.arguments) == (
        "function", "calculator", '{"expression": "2*3"}')  # fmt: skip
    # the parser read the sampled text with its special tokens (tool-call tags may be special)
    ids = extra(choice, "token_ids")
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert SEEN[0] == tiny_tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=False)
    assert choice.message.content == (SEEN[0].strip() or None)
    streamed = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or ())]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == [
        (0, "calculator", '{"expression": "2*3"}')]  # fmt: skip
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == [
        "tool_calls"]  # fmt: skip
    for plain in (refused, no_tools):  # not asked for tools: the text, as before
        assert plain.choices[0].message.tool_calls is None
        assert plain.choices[0].finish_reason in ("stop", "length")
    assert len(SEEN) == 2  # the two requests with tools
