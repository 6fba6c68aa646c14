"""Thinking templates that re-render earlier turns (Qwen3's rules) train token-exactly by branching.

The tiny model with `QWEN3_STYLE_CHAT_TEMPLATE` (training/backend/tiny_model.py): an assistant
turn's think block is kept only after the last user turn, and only the last assistant turn
always carries one. So after every model turn the history renders differently once the tool's
answer follows, and each next turn is a branch: a new sample whose prompt is the re-rendered
history. The property pinned on the built-in multi-turn path, the agent proxy and a short RL run:
trained tokens are the sampled tokens, and the loss mask is 1 on sampled tokens only.
"""

from __future__ import annotations

import json
import shutil
from itertools import pairwise

import pytest
from rl_helpers import Call, RecordingEngine
from transformers import AutoTokenizer

from rollouts.agent import AgentConfig, agent_generate, python_harness
from rollouts.chat_turns import ChatTurns
from rollouts.envs import arithmetic_grader, tool_env_factory
from rollouts.multiturn import MultiTurnConfig, multiturn_generate
from rollouts.prompts import encode_prompt
from rollouts.tools import tool_message
from tests.test_agent_proxy import SPECS, TOOLS, calculator_agent, greedy_ctx, prompt_for, scripted
from training.backend.tiny_model import QWEN3_STYLE_CHAT_TEMPLATE

USER = {"role": "user", "content": "2*3"}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'


@pytest.fixture(scope="module")
def qwen3_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model's weights with the Qwen3-style template (what `make_tiny_model.py
    --template qwen3` writes, without training the tokenizer again)."""
    out = tmp_path_factory.mktemp("qwen3_tiny")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = QWEN3_STYLE_CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def qwen3_tok(qwen3_model_dir):
    return AutoTokenizer.from_pretrained(qwen3_model_dir)


def token_violations(samples, calls: list[Call]) -> list[str]:
    """Breaks of "trained tokens are the sampled tokens, masks only on sampled tokens".

    Each engine call of a rollout (its rid: `{prefix}-{index_in_group}-...`) must be inside
    exactly one of the rollout's samples (its input a prefix of the sample's ids, its output
    right after), each sample's prompt must be one call's whole input, the mask must be 1
    exactly on the calls' outputs, and the logprobs there the engine's.
    """
    out, owners = [], [0] * len(calls)
    for s in samples:
        full, n_prompt = s.prompt_ids + s.response_ids, len(s.prompt_ids)
        sampled: dict[int, float] = {}
        starts = []
        for j, c in enumerate(calls):
            if c.rid.split("-")[-2] != str(s.index_in_group):
                continue
            n, got = len(c.input_ids), tuple(c.result.output_ids)
            if n >= n_prompt and full[:n] == c.input_ids and full[n : n + len(got)] == got:
                owners[j] += 1
                starts.append(n)
                sampled.update(zip(range(n - n_prompt, n - n_prompt + len(got)),
                                   c.result.output_logprobs, strict=True))  # fmt: skip
        key = (s.index_in_group, s.sub_index)
        if n_prompt not in starts:
            out.append(f"{key}: no call was sent this prompt")
        if len(s.loss_mask) != len(s.response_ids):
            out.append(f"{key}: {len(s.loss_mask)} mask values for {len(s.response_ids)} tokens")
        out += [f"{key}: token {i} masked {m}, sampled {i in sampled}"
                for i, m in enumerate(s.loss_mask) if m != (i in sampled)]  # fmt: skip
        out += [f"{key}: token {i} logprob {s.rollout_logprobs[i]} != engine {lp}"
                for i, lp in sampled.items() if s.rollout_logprobs[i] != lp]  # fmt: skip
    out += [f"call {j} is in {k} samples" for j, k in enumerate(owners) if k != 1]
    return out


def test_a_history_the_template_renders_differently_is_not_extended(qwen3_tok):
    chat = ChatTurns.from_tokenizer(qwen3_tok)
    tool = {"role": "tool", "content": "6"}
    eos = qwen3_tok.convert_tokens_to_ids("<|im_end|>")
    plain = {"role": "assistant", "content": CALL}  # no reasoning: its empty think block goes
    assert chat.appended_ids([eos], [tool], history=[USER, plain]) is None
    reasoned = {"role": "assistant", "content": f"<think>\nmultiply\n</think>\n\n{CALL}"}
    appended = chat.appended_ids([eos], [tool], history=[USER, reasoned])  # kept: extendable
    whole = encode_prompt(qwen3_tok, [USER, reasoned, tool])
    assert appended is not None and whole[-len(appended) + 1 :] == appended[1:]
    assert qwen3_tok.decode(appended) == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"
    # a new user turn drops the earlier reasoning
    assert chat.appended_ids([eos], [USER], history=[USER, reasoned]) is None
    # the template-independent question (no history) says the template is not extendable
    assert chat.appended_ids([eos], [tool]) is None


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
async def test_builtin_tool_episodes_branch_and_train_only_sampled_tokens(local_engine, qwen3_tok,
                                                                          kwargs):  # fmt: skip
    _, engine = local_engine
    tok, recording = qwen3_tok, RecordingEngine(engine)
    generate = multiturn_generate(
        tool_env_factory(TOOLS, arithmetic_grader, parser=scripted(*["2*3"] * 6)),
        tokenizer=tok, config=MultiTurnConfig(max_turns=3, template_kwargs=kwargs),
    )  # fmt: skip
    prompt = prompt_for(tok, 2, 3)
    samples = await generate(prompt, 2, greedy_ctx(recording, tok, f"q{len(kwargs)}"))
    assert token_violations(samples, recording.calls) == []
    assert len(recording.calls) == 6  # 3 turns per episode: every turn after the first branches
    assert sorted((s.index_in_group, s.sub_index) for s in samples) == [
        (i, k) for i in range(2) for k in range(3)]  # fmt: skip
    for i in range(2):
        branches = sorted((s for s in samples if s.index_in_group == i), key=lambda s: -s.sub_index)
        assert branches[-1].status == "truncated"  # max_turns passed with a call pending
        assert {s.reward for s in branches} == {branches[-1].reward}
        # each branch is one sampled turn; the next one's prompt is the history re-rendered
        # (the episode's tool calls, one per turn, are all on the sample that stands for it)
        messages, records = [dict(m) for m in prompt.messages], branches[-1].tool_calls
        assert len(records) == 3 and all(not b.tool_calls for b in branches[:-1])
        for j, (branch, following) in enumerate(pairwise(branches)):
            assert set(branch.loss_mask) == {1}
            text = ChatTurns.from_tokenizer(tok).decode_turn(branch.response_ids)
            messages += [{"role": "assistant", "content": text}, tool_message(records[j])]
            assert following.prompt_ids == tuple(encode_prompt(tok, messages, SPECS,
                                                               template_kwargs=kwargs))  # fmt: skip


async def test_agent_proxy_sessions_branch_and_train_only_sampled_tokens(local_engine, qwen3_tok):
    _, engine = local_engine
    tok, recording = qwen3_tok, RecordingEngine(engine)
    generate = agent_generate(python_harness(calculator_agent), tokenizer=tok,
                              config=AgentConfig(timeout_s=60, parser=scripted("2*3", "1+1")))  # fmt: skip
    samples = await generate(prompt_for(tok, 2, 3), 1, greedy_ctx(recording, tok, "qa"))
    assert token_violations(samples, recording.calls) == []
    assert [s.sub_index for s in samples] == [0, 1, 2] and len(recording.calls) == 3
    assert all(s.status == "completed" for s in samples), [s.error for s in samples]
    assert samples[0].metadata["agent_branches"] == 3
    assert samples[0].prompt_ids == recording.calls[-1].input_ids  # the last call's branch


async def checking_agent(client, task) -> float:
    """Answers, is asked to check, answers again: the user turn re-renders the first answer."""
    messages = list(task["messages"])
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Check it."}]  # fmt: skip
    return arithmetic_grader(messages[-2].get("content") or "", task["metadata"])


async def test_rl_on_the_tool_task_with_the_qwen3_template_trains_every_branch(qwen3_model_dir,
                                                                                tmp_path):  # fmt: skip
    from tests.distributed_launch import ROOT
    from training.config import load_config
    from training.recipes.rl import RLExtensions, run_rl_recipe
    from training.rl.dump_audit import read_dump_lines
    from training.rl_config import RLRunConfig

    config = load_config(RLRunConfig, ROOT / "configs" / "agent_tiny.yaml", [
        f"output_dir={tmp_path / 'out'}", f"model.path={qwen3_model_dir}",
        f"data.task_dir={tmp_path / 'data'}", "data.multiply.n_sft=4", "data.multiply.n_rl=16",
        "data.multiply.n_eval=4", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.filter_groups=none", "rollout.sampling.max_new_tokens=8", "train.max_steps=2",
        "train.eval_every=100", "train.eval_samples=4", "train.dump_rollouts=true",
    ])  # fmt: skip
    summary = await run_rl_recipe(config, extensions=RLExtensions(agent=checking_agent))
    rows = [json.loads(r) for r in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert summary.steps == 2 and [r["step"] for r in rows] == [1, 2]
    assert all(r["samples_failed"] == 0 for r in rows), rows
    lines = read_dump_lines(tmp_path / "out" / "rollouts.jsonl")
    assert len(lines) == 2
    for _, batch in lines:
        # 2 groups x 2 sessions x 2 branches (the check's user turn re-renders the answer)
        assert sorted((s.index_in_group, s.sub_index) for s in batch.samples) == sorted(
            [(i, k) for i in range(2) for k in range(2)] * 2)  # fmt: skip
        for s in batch.samples:  # engine logprobs (< 0) on sampled tokens only, 0.0 elsewhere
            assert s.status in ("completed", "truncated") and len(s.loss_mask) == len(
                s.response_ids
            )
            assert all((lp < 0) == bool(m)
                       for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True))  # fmt: skip
