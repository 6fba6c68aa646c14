"""Every branch of an agent session is trained as its own sample (issue 29).

A call that rewrites history starts a new branch; the group then holds more samples than its
n sessions, each with its branch's exact tokens, and the RL step normalises advantages over
all of them. Local engine over loopback HTTP, the real `openai` client, the tiny model.
"""

from __future__ import annotations

import pytest
import torch
import trio

from rollouts.agent import agent_generate, python_harness
from rollouts.envs import env_reward
from rollouts.generation import GroupSource, collect_groups, convert_to_batch, keep_all
from rollouts.prompts import encode_prompt, prompt_item
from tests.rl_helpers import rl_backend
from tests.test_agent_proxy import greedy_ctx
from training.rl.advantages import grpo_advantages
from training.rl.algorithms import grpo
from training.rl.batch import build_examples
from training.rl.step import train_on_batch

openai = pytest.importorskip("openai")

USER = {"role": "user", "content": "2*3"}
AGAIN = {"role": "user", "content": "again"}
REWRITTEN = [USER, {"role": "assistant", "content": "6"}, AGAIN]


def branching_agent():
    """Two calls that extend one branch; then, in the sessions the task says, a third call
    that rewrites the first answer (a new branch). Rewards 0, 1, ... in session start order."""
    started: dict[str, int] = {}

    async def agent(client, task) -> float:
        name = task["metadata"]["name"]
        k = started[name] = started.get(name, -1) + 1
        first = await client.chat.completions.create(model="policy", messages=[USER])
        said = first.choices[0].message.content or ""
        extended = [USER, {"role": "assistant", "content": said}, AGAIN]
        await client.chat.completions.create(model="policy", messages=extended)
        if k < task["metadata"]["rewriting_sessions"]:
            await client.chat.completions.create(model="policy", messages=REWRITTEN)
        return float(k)

    return agent


async def test_each_branch_of_a_session_trains_as_its_own_sample_with_its_exact_tokens(
    local_engine, tiny_model_dir, tiny_tokenizer, tmp_path
):
    _, engine = local_engine
    tok = tiny_tokenizer
    # group 0: both sessions rewrite history (4 samples); group 1: only the first (3 samples)
    items = iter([prompt_item(tok, [USER], {"name": "all", "rewriting_sessions": 2}),
                  prompt_item(tok, [USER], {"name": "first", "rewriting_sessions": 1})])  # fmt: skip
    result = await collect_groups(
        GroupSource(lambda: (next(items), [])), n_groups=2, n_samples=2, engine=engine,
        sampling_params=greedy_ctx(engine, tok, "b").sampling_params, reward_fn=env_reward,
        generate_fn=agent_generate(python_harness(branching_agent()), tokenizer=tok),
        group_filter=keep_all, limiter=trio.CapacityLimiter(1),  # one request at a time: greedy
    )  # fmt: skip
    assert result.n_failed_groups == 0 and result.n_failed_samples == 0
    by_name = {g[0].metadata["name"]: g for g in result.accepted}
    rewriting, mixed = by_name["all"], by_name["first"]
    assert [(s.index_in_group, s.sub_index) for s in rewriting] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    keys = [(s.index_in_group, s.sub_index) for s in mixed]  # which session branched: a race
    assert keys in ([(0, 0), (0, 1), (1, 0)], [(0, 0), (1, 0), (1, 1)])

    plain = next(s for s in mixed if s.metadata["agent_branches"] == 1)  # did not branch
    for group in (rewriting, mixed):
        for i in {s.index_in_group for s in group if s.metadata["agent_branches"] == 2}:
            last, other = (s for s in group if s.index_in_group == i)
            # the last call's branch stands for the session: the rewritten history, all sampled
            assert last.prompt_ids == tuple(encode_prompt(tok, REWRITTEN))
            assert set(last.loss_mask) == {1} and all(lp < 0 for lp in last.rollout_logprobs)
            # the other branch: the first two calls, exactly as a session that never branched
            assert other.prompt_ids == tuple(encode_prompt(tok, [USER]))
            assert (other.response_ids, other.loss_mask) == (plain.response_ids, plain.loss_mask)
            # the engine's logprobs, up to float noise between two forward passes
            assert other.rollout_logprobs == pytest.approx(plain.rollout_logprobs, abs=1e-4)
            assert _runs(other.loss_mask) == [1, 0, 1]
            appended = [
                t for t, m in zip(other.response_ids, other.loss_mask, strict=True) if not m
            ]
            assert tok.decode(appended).endswith("<|im_start|>user\nagain<|im_end|>\n"
                                                 "<|im_start|>assistant\n")  # fmt: skip
            assert last.reward == other.reward  # the session's reward, on each branch

    batch = convert_to_batch([rewriting, mixed], epoch_id=0, step_id=1)
    assert batch.metrics["n_samples"] == 7.0 and len(batch.groups) == 2
    examples = build_examples(batch, grpo())
    assert len(examples) == 7
    for g, group in enumerate(batch.groups):
        want = grpo_advantages(torch.tensor([[s.reward for s in group]]))[0].tolist()
        assert [e.advantage for e in examples if e.group == g] == pytest.approx(want)
        assert [e.input_ids for e in examples if e.group == g] == [
            s.prompt_ids + s.response_ids for s in group]  # fmt: skip
    assert any(e.advantage != 0 for e in examples)

    backend = rl_backend(tiny_model_dir, tmp_path)
    with backend:
        metrics = await train_on_batch(backend, batch, grpo(), temperature=1.0,
                                       old_from_rollout=True, reference=None)  # fmt: skip
    assert metrics["n_samples"] == 7.0 and metrics["step"] == 1


def _runs(mask) -> list[int]:
    """The mask's values with repeats collapsed: [1, 1, 0, 1] -> [1, 0, 1]."""
    return [m for i, m in enumerate(mask) if i == 0 or mask[i - 1] != m]


async def test_a_held_session_is_kept_or_redone_whole_never_duplicated(
    local_engine, tiny_tokenizer
):
    """A held group (cut short, served again) whose session 0 has one branch too stale to
    reuse: that session is generated again, all of its branches, and session 1's are reused;
    no (session, branch) appears twice."""
    from dataclasses import replace

    from rollouts.config import RolloutConfig, SamplingConfig
    from rollouts.manager import AsyncRolloutManager
    from training.data.buffer import DataBuffer

    _, engine = local_engine
    tok = tiny_tokenizer
    item = prompt_item(tok, [USER], {"name": "all", "rewriting_sessions": 9})
    generate_fn = agent_generate(python_harness(branching_agent()), tokenizer=tok)
    first = await collect_groups(
        GroupSource(lambda: (item, [])), n_groups=1, n_samples=2, engine=engine,
        sampling_params=greedy_ctx(engine, tok, "h").sampling_params, reward_fn=env_reward,
        generate_fn=generate_fn, group_filter=keep_all, limiter=trio.CapacityLimiter(1),
    )  # fmt: skip
    (group,) = first.accepted
    # all at version 3 but session 0's other branch, left at 0 (stale at version 3, sync mode)
    held = [replace(s, weight_version=0 if (s.index_in_group, s.sub_index) == (0, 1) else 3)
            for s in group]  # fmt: skip
    buffer = DataBuffer([item], seed=0)
    buffer.hold([{"prompt": item.to_dict(), "samples": [s.to_dict() for s in held]}], 3)
    cfg = RolloutConfig(sampling=SamplingConfig(temperature=0.0, max_new_tokens=6),
                        batch_size=1, n_samples_per_prompt=2, filter_groups="none")  # fmt: skip
    manager = AsyncRolloutManager(engine, buffer, cfg, reward_fn=env_reward,
                                  generate_fn=generate_fn, current_version=lambda: 3,
                                  tokenizer=tok)  # fmt: skip
    (served,) = (await manager.generate_batch()).groups
    assert [(s.index_in_group, s.sub_index) for s in served] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s.weight_version for s in served] == [0, 0, 3, 3]  # session 0 redone, 1 reused


async def test_a_dropped_branch_sample_redoes_its_whole_session(local_engine, tiny_tokenizer):
    """A reward's DropSample on an extra branch fails its session: under sample_retries the
    session is generated again, all of its branches, and its old samples are not kept."""
    from rollouts.errors import DropSample

    _, engine = local_engine
    tok = tiny_tokenizer
    item = prompt_item(tok, [USER], {"name": "all", "rewriting_sessions": 9})
    dropped = []

    def reward(sample):
        if sample.sub_index == 1 and not dropped:
            dropped.append(sample.index_in_group)
            raise DropSample("the judge could not read this branch")
        return env_reward(sample)

    result = await collect_groups(
        GroupSource(lambda: (item, [])), n_groups=1, n_samples=2, engine=engine,
        sampling_params=greedy_ctx(engine, tok, "d").sampling_params, reward_fn=reward,
        generate_fn=agent_generate(python_harness(branching_agent()), tokenizer=tok),
        group_filter=keep_all, limiter=trio.CapacityLimiter(1), sample_retries=1,
    )  # fmt: skip
    (group,) = result.accepted
    assert [(s.index_in_group, s.sub_index) for s in group] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert result.n_retried_samples == 1 and len(dropped) == 1
    assert all(s.status == "completed" for s in group)


def _call(call_id: str, expression: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": expression}}}  # fmt: skip


async def test_forked_branch_keeps_only_its_own_tool_calls(tiny_tokenizer):
    """An agent fans out after a tool call (two calls from the same history, in flight at
    once): each branch's Sample.tool_calls are exactly the tool results whose tokens are in
    that branch's response, in order, even when its sibling ran more tools before the fork
    was recorded (issue 42, W3)."""
    import re

    from rollouts.agent.generate import branch_sample
    from rollouts.agent.proxy import AgentSession, SessionLimits
    from rollouts.agent.trajectory import SessionTrajectory
    from rollouts.chat_turns import ChatTurns
    from rollouts.generate_fn import GenerateContext
    from rollouts.tools import calculator_tool, tool_specs

    tok = tiny_tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    specs = tool_specs([calculator_tool()])
    trajectory = SessionTrajectory(ChatTurns.from_tokenizer(tok))

    def call(messages, answer, text):
        plan = trajectory.plan(messages, specs)
        return plan, lambda: trajectory.record(
            plan, messages, answer, [*tok.encode(text, add_special_tokens=False), eos],
            None, [(0, 1, 0)], "stop", specs)  # fmt: skip

    first = {"role": "assistant", "content": "", "tool_calls": [_call("c1", "2*3")]}
    _, record = call([USER], first, "<tool_call>2*3</tool_call>")
    record()
    shared = [USER, first, {"role": "tool", "tool_call_id": "c1", "content": "6"}]
    fan = {q: [*shared, {"role": "user", "content": q}] for q in ("a?", "b?")}
    a_answer = {"role": "assistant", "content": "", "tool_calls": [_call("c2", "4+4")]}
    _, record_a = call(fan["a?"], a_answer, "<tool_call>4+4</tool_call>")
    _, record_b = call(fan["b?"], {"role": "assistant", "content": "b"}, "b")  # planned now
    record_a()
    a_more = [*fan["a?"], a_answer, {"role": "tool", "tool_call_id": "c2", "content": "8"}]
    _, record_a_more = call(a_more, {"role": "assistant", "content": "8"}, "8")
    record_a_more()
    record_b()  # recorded last: it forks branch 0 at the shared prefix
    assert len(trajectory.branches) == 2

    ctx = GenerateContext(None, {}, trio.CapacityLimiter(1), "t", 0, tok)
    session = AgentSession("s", "k", "http://x", ctx, 0, trajectory, SessionLimits())
    prompt = prompt_item(tok, [USER], {})
    outputs = {}
    for branch in trajectory.branches:
        sample = branch_sample(session, branch, prompt)
        # the tiny model's template renders a tool result as its own "tool" turn
        in_tokens = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", sample.response_text)
        assert [c.output for c in sample.tool_calls] == in_tokens
        outputs[tok.decode(branch.ids).count("b?")] = in_tokens
    assert outputs == {0: ["6", "8"], 1: ["6"]}  # branch a, and b (forked)
