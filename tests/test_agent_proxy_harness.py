"""Agent harnesses against the real local engine: subprocesses in another program, faults
counted by the rollout's metrics, and a group of sessions through `collect_groups`."""

from __future__ import annotations

import sys
import textwrap

import pytest
import trio

from rollouts.agent import AgentConfig, agent_generate, python_harness, subprocess_harness
from rollouts.agent.harness import HarnessError, read_reward
from rollouts.envs import env_reward
from rollouts.generation import GroupSource, collect_groups, keep_all
from tests.test_agent_proxy import calculator_agent, greedy_ctx, prompt_for

pytest.importorskip("openai")

AGENT = textwrap.dedent("""
    import json, os, sys
    from openai import OpenAI
    task = json.load(sys.stdin)
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    reply = client.chat.completions.create(model="policy", messages=task["messages"])
    print("some log line")
    print(1.0 if reply.choices[0].message.content is not None else 0.0)
""")
CRASH = "import sys; sys.stderr.write('agent crashed on purpose\\n'); sys.exit(3)"
HANG = "import time; time.sleep(60)"


@pytest.mark.parametrize("kind", ["works", "crash", "hang"])
async def test_subprocess_harness_gets_the_session_and_its_faults_fail_only_its_sample(
    local_engine, tiny_tokenizer, tmp_path, kind
):
    _, engine = local_engine
    tok = tiny_tokenizer
    script = tmp_path / "agent.py"
    script.write_text({"works": AGENT, "crash": CRASH, "hang": HANG}[kind])
    fn = agent_generate(subprocess_harness([sys.executable, str(script)]), tokenizer=tok,
                        config=AgentConfig(timeout_s=20.0 if kind == "works" else 1.5))  # fmt: skip
    with trio.fail_after(30):  # the hung program is killed: SIGTERM at 1.5 s
        (sample,) = await fn(prompt_for(tok, 2, 3), 1, greedy_ctx(engine, tok, kind))
    if kind == "works":
        assert sample.status == "completed", sample.error
        assert sample.reward == 1.0 and sum(sample.loss_mask) > 0
    elif kind == "crash":
        assert sample.status == "failed"
        assert "exited with status 3: agent crashed on purpose" in sample.error
    else:
        assert sample.status == "failed" and "timed out after 1.5 s" in sample.error


def test_reward_is_the_last_line_of_stdout():
    assert read_reward(b"log\n0.5\n\n", "a") == 0.5
    assert read_reward(b"", "a") is None and read_reward(b"null\n", "a") is None
    with pytest.raises(HarnessError, match="last line of stdout must be the reward"):
        read_reward(b"done", "./agent")


async def test_failed_sessions_are_counted_and_retried_not_fatal(local_engine, tiny_tokenizer):
    """GRPO's group = n concurrent sessions of one task; a session whose agent raises fails
    its sample: its group is dropped and counted with the cause, and the run goes on with the
    next group (as for a failed reward or engine error)."""
    _, engine = local_engine
    tok = tiny_tokenizer
    prompt = prompt_for(tok, 12, 34)
    calls = []

    async def flaky(client, task):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("agent lost its network")
        return await calculator_agent(client, task)

    ctx = greedy_ctx(engine, tok, "g")
    result = await collect_groups(
        GroupSource(lambda: (prompt, [])), n_groups=1, n_samples=3, engine=engine,
        sampling_params=ctx.sampling_params, reward_fn=env_reward,
        generate_fn=agent_generate(python_harness(flaky), tokenizer=tok),
        group_filter=keep_all, limiter=trio.CapacityLimiter(4),
    )  # fmt: skip
    (group,) = result.accepted
    assert sorted(s.index_in_group for s in group) == [0, 1, 2]
    assert all(s.status == "completed" for s in group) and len(calls) == 6
    assert result.n_failed_samples == 1 and result.n_failed_groups == 1
    assert result.metrics()["samples_failed"] == 1.0
    ((error, count),) = result.sample_errors.items()
    assert "ConnectionError: agent lost its network" in error and count == 1


async def test_the_proxy_is_gone_when_its_group_is_done(local_engine, tiny_tokenizer):
    """A harness that leaves something behind cannot reach its session after the group."""
    import httpx

    _, engine = local_engine
    tok = tiny_tokenizer
    seen = []

    async def agent(client, task):
        seen.append(str(client.base_url))
        return await calculator_agent(client, task)

    fn = agent_generate(python_harness(agent), tokenizer=tok)
    (sample,) = await fn(prompt_for(tok, 5, 6), 1, greedy_ctx(engine, tok, "gone"))
    assert sample.status == "completed"
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(seen[0] + "models")


def test_agent_config_fails_loudly_on_unknown_keys_and_a_missing_agent():
    from plumbing.errors import ConfigError
    from training.recipes.rl import resolve_callable
    from training.recipes.rl_env import build_episode_setup
    from training.rl_config import RLRunConfig

    with pytest.raises(ValueError, match="timeout"):
        RLRunConfig.model_validate({"env": {"kind": "agent"}, "agent": {"timeout": 5}})
    with pytest.raises(ValueError, match="command or fn, not both"):
        RLRunConfig.model_validate({"agent": {"command": ["a"], "fn": "m:f"}})
    config = RLRunConfig.model_validate({"env": {"kind": "agent"}})
    with pytest.raises(ConfigError, match="set agent.command or agent.fn"):
        build_episode_setup(config.env, config.reward, resolve=resolve_callable,
                            agent_section=config.agent)  # fmt: skip
    config = RLRunConfig.model_validate({"env": {"kind": "agent"},
                                         "agent": {"command": ["./agent"], "timeout_s": 9}})  # fmt: skip
    setup = build_episode_setup(config.env, config.reward, resolve=resolve_callable,
                                agent_section=config.agent)  # fmt: skip
    assert setup.reward_fn is env_reward


async def test_an_agent_prompt_over_the_context_fails_its_samples_with_the_engines_error(
    local_engine, tiny_tokenizer
):
    """Issue 49 D2: the engine's 400 (a prompt past the context) for a call an agent made is the
    agent's fault, like a bad request body: its sample fails with the engine's text, counted, and
    `collect_groups` returns (the run goes on) instead of raising out of the nested nurseries."""
    _, engine = local_engine
    tok = tiny_tokenizer
    calls = []

    async def long_winded(client, task):
        calls.append(1)
        messages = [*task["messages"], {"role": "user", "content": " word" * 3000}]
        await client.chat.completions.create(model="policy", messages=messages)
        return 1.0

    ctx = greedy_ctx(engine, tok, "long")
    with trio.fail_after(60):
        result = await collect_groups(
            GroupSource(lambda: (prompt_for(tok, 2, 3), [])), n_groups=1, n_samples=2,
            engine=engine, sampling_params=ctx.sampling_params, reward_fn=env_reward,
            generate_fn=agent_generate(python_harness(long_winded), tokenizer=tok),
            group_filter=keep_all, limiter=trio.CapacityLimiter(4), max_launches=2,
            sample_retries=1,
        )  # fmt: skip
    assert result.accepted == [] and result.n_failed_groups == 2
    assert result.n_failed_samples == 4 and not result.failures  # not an engine outage
    # failed samples, generated again once like any (sample_retries=1): 2 groups x 2 x 2 calls
    assert len(calls) == 8 and result.n_retried_samples == 4
    ((error, count),) = result.sample_errors.items()
    assert count == 4 and "(HTTP 400)" in error and "context length" in error, error


async def test_a_non_json_engine_answer_in_an_agent_session_is_retried_not_a_crash(
    local_engine, tiny_tokenizer
):
    """Issue 49 D2: an engine error an agent's session saw is re-raised through two nurseries
    (the sessions', the scoring's); a non-JSON 200 (a misrouted load balancer) is transient, so
    the session is generated again and its group trains, instead of an AttributeError."""
    from engines import SGLangEngine
    from engines.testing.fault_proxy import FaultPlan, FaultProxy

    server, _ = local_engine
    tok = tiny_tokenizer
    async with trio.open_nursery() as nursery:
        proxy = FaultProxy(server.url, FaultPlan(script=("nonjson",)))
        url = await nursery.start(proxy.serve)
        async with SGLangEngine(url, max_retries=0) as engine:
            ctx = greedy_ctx(engine, tok, "nonjson")
            with trio.fail_after(60):
                result = await collect_groups(
                    GroupSource(lambda: (prompt_for(tok, 2, 3), [])), n_groups=1, n_samples=2,
                    engine=engine, sampling_params=ctx.sampling_params, reward_fn=env_reward,
                    generate_fn=agent_generate(python_harness(calculator_agent), tokenizer=tok),
                    group_filter=keep_all, limiter=trio.CapacityLimiter(4), sample_retries=1,
                )  # fmt: skip
        nursery.cancel_scope.cancel()
    assert proxy.counts["nonjson"] == 1
    (group,) = result.accepted
    assert sorted(s.index_in_group for s in group if s.sub_index == 0) == [0, 1]
    assert all(s.status in ("completed", "truncated") for s in group)
    assert result.n_retried_samples >= 1 and result.n_failed_groups == 0


async def test_an_evaluation_counts_failed_agent_episodes_as_failed_not_as_reward_failures(
    local_engine, tiny_tokenizer
):
    """An episode whose agent's call the engine refused has no answer to score: the evaluation
    counts it in `failed` (with the engine's text), not in `reward_failed`."""
    from rollouts.evaluation import evaluate_greedy

    _, engine = local_engine
    tok = tiny_tokenizer

    async def long_winded(client, task):
        messages = [*task["messages"], {"role": "user", "content": " word" * 3000}]
        await client.chat.completions.create(model="policy", messages=messages)
        return 1.0

    with trio.fail_after(60):
        out = await evaluate_greedy(
            engine, [prompt_for(tok, 2, 3), prompt_for(tok, 4, 5)], env_reward, tokenizer=tok,
            generate_fn=agent_generate(python_harness(long_winded), tokenizer=tok),
        )  # fmt: skip
    assert out["failed"] == 2 and out["reward_failed"] == 0 and out["scored"] == 0
