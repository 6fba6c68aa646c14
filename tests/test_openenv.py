"""`env.kind: openenv`: episodes in a real OpenEnv MCP tool environment over its wire protocol.

The env server is real: examples/openenv_calculator_env.py, written with OpenEnv's own
`MCPEnvironment` and `create_app`, served by uvicorn on 127.0.0.1 in a subprocess (one per
module; the recipe test and the crash test start their own through `serve_env_app`). It logs
every tool call it receives (OPENENV_CALCULATOR_LOG); the tests read that log. The tiny model
is untrained, so, as in test_multiturn, the tests script the *parser* (an extension point) to
read given calls from each turn; the engine samples every token.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import trio

from engines.launch import find_free_port
from plumbing.errors import ConfigError
from rollouts.envs import env_reward
from rollouts.generation import GroupSource, collect_groups, keep_all
from rollouts.multiturn import MultiTurnConfig
from rollouts.openenv import (
    OpenEnvConfig,
    OpenEnvError,
    check_server,
    fetch_tasks,
    open_session,
    openenv_generate,
    serve_env_app,
    task_records,
)
from rollouts.prompts import PromptItem, encode_prompt
from rollouts.tools import ParsedToolCall
from tests.distributed_launch import ROOT
from tests.test_multiturn import RecordingEngine, make_ctx, sampled_spans
from training.config import load_config
from training.rl_config import RLRunConfig

APP = "examples.openenv_calculator_env:app"
# the env servers need the `openenv` package (the dev and openenv extras); looked up, not imported
needs_openenv = pytest.mark.skipif(importlib.util.find_spec("openenv") is None,
                                   reason="pip install -e .[dev] (or .[openenv]) for openenv")  # fmt: skip
CALC_SPEC = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.",
    "parameters": {"additionalProperties": False, "properties": {"expression": {"type": "string"}},
                   "required": ["expression"], "type": "object"}}}  # fmt: skip
SUBMIT_SPEC = {"type": "function", "function": {
    "name": "submit_answer", "description": "Submit the final answer; this ends the episode.",
    "parameters": {"additionalProperties": False, "properties": {"answer": {"type": "string"}},
                   "required": ["answer"], "type": "object"}}}  # fmt: skip


@pytest.fixture(scope="module")
def env_server(tmp_path_factory):
    """(url, call log) of the calculator env served by uvicorn for this module."""
    log = tmp_path_factory.mktemp("openenv") / "calls.jsonl"
    port = find_free_port()
    env = {**os.environ, "OPENENV_CALCULATOR_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", APP, "--host", "127.0.0.1", "--port",
                             str(port), "--log-level", "warning"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120  # the first import of openenv is slow on a cold disk
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the env server did not answer /health in 120 s"
        time.sleep(0.2)
    yield url, log
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def env_calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def scripted(*turns: list[ParsedToolCall]):
    """A parser that 'reads' the given calls from successive turns, then none."""
    remaining = list(turns)
    return lambda text: remaining.pop(0) if remaining else []


def task_prompt(tok, url: str, split: str, index: int) -> PromptItem:
    record = task_records(fetch_tasks(url, "calculator", split, limit=index + 1), split,
                          "prompt")[index]  # fmt: skip
    meta = {k: v for k, v in record.items() if k != "messages"}
    return PromptItem(
        tuple(encode_prompt(tok, record["messages"])), tuple(record["messages"]), meta
    )


@needs_openenv
def test_tasks_of_the_env_task_provider_become_prompt_records(env_server):
    url, _ = env_server
    records = task_records(fetch_tasks(url, "calculator", "test", limit=3), "test", "prompt")
    for i, record in enumerate(records):  # the same tasks through another route, get_task
        task = httpx.post(f"{url}/calculator/task", json={"split": "test", "index": i},
                          trust_env=False).json()["task"]  # fmt: skip
        assert record == {"messages": [{"role": "user", "content": task["prompt"]}],
                          "id": task["id"], "answer": task["answer"], "split": "test", "index": i,
                          "reset": {"split": "test", "index": i}}  # fmt: skip
    with pytest.raises(OpenEnvError, match=r"/calculator/task_range: split 'nope' answered HTTP"):
        fetch_tasks(url, "calculator", "nope")
    with pytest.raises(OpenEnvError, match="no string field 'question'"):
        task_records(fetch_tasks(url, "calculator", "test", limit=1), "test", "question")


@needs_openenv
async def test_an_episode_is_the_env_tools_calls_rewards_and_exactly_the_sampled_tokens(
    env_server, local_engine, tiny_tokenizer
):
    url, log = env_server
    _, engine = local_engine
    tok = tiny_tokenizer
    prompt = task_prompt(tok, url, "test", 1)
    answer = prompt.metadata["answer"]
    parser = scripted([ParsedToolCall("calculator", {"expression": "6*7"})],
                      [ParsedToolCall("submit_answer", {"answer": f"It is {answer}."})])  # fmt: skip
    proxy = RecordingEngine(engine)
    generate = openenv_generate(OpenEnvConfig(url=url), url, parser=parser,
                                multiturn=MultiTurnConfig(max_turns=4))  # fmt: skip
    seen = len(env_calls(log))
    (sample,) = await generate(prompt, 1, make_ctx(proxy, tok))

    assert sample.status == "completed" and sample.reward == 1.0, sample.error
    assert env_reward(sample) == {"env_done": 1.0, "total": 1.0}
    received = [(c["task"], c["tool"], c["arguments"], c["reward"], c["done"])
                for c in env_calls(log)[seen:]]  # fmt: skip
    assert received == [("test-1", "calculator", {"expression": "6*7"}, None, False),
                        ("test-1", "submit_answer", {"answer": f"It is {answer}."}, 1.0, True)]  # fmt: skip
    assert [(r.name, r.output, r.success) for r in sample.tool_calls] == [
        ("calculator", "42", True), ("submit_answer", "submitted", True)]  # fmt: skip
    # the chat template's tools are the ones the env listed
    calls = proxy.calls
    assert calls[0].input_ids == sample.prompt_ids == tuple(
        encode_prompt(tok, list(prompt.messages), [CALC_SPEC, SUBMIT_SPEC]))  # fmt: skip
    # trained tokens = what the engine saw and sampled; mask 1 exactly on the sampled ones
    full = sample.prompt_ids + sample.response_ids
    assert len(calls) == 2 and full == calls[-1].input_ids + calls[-1].result.output_ids
    for call in calls:
        assert full[: len(call.input_ids)] == call.input_ids
    sampled = {i for start, end in sampled_spans(sample, calls) for i in range(start, end)}
    assert [int(i in sampled) for i in range(len(sample.response_ids))] == list(sample.loss_mask)
    appended = tok.decode([t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True)
                           if not m], skip_special_tokens=False)  # fmt: skip
    assert "<|im_start|>tool\n42<|im_end|>" in appended  # the env's observation, as a tool turn


@needs_openenv
async def test_a_plain_answer_is_submitted_and_a_wrong_call_is_shown_to_the_model(
    env_server, local_engine, tiny_tokenizer
):
    url, log = env_server
    _, engine = local_engine
    prompt = task_prompt(tiny_tokenizer, url, "test", 2)
    parser = scripted([ParsedToolCall("calculator", {"expression": "__import__('os')"}),
                       ParsedToolCall("search", {"q": "x"})])  # then a turn without calls  # fmt: skip
    config = OpenEnvConfig(url=url, answer_tool="submit_answer")
    generate = openenv_generate(config, url, parser=parser, multiturn=MultiTurnConfig(max_turns=3))
    seen = len(env_calls(log))
    (sample,) = await generate(prompt, 1, make_ctx(engine, tiny_tokenizer))

    first, unknown, submitted = sample.tool_calls
    assert not first.success and "not allowed" in first.error  # the env's tool error, shown
    assert not unknown.success and "unknown tool 'search'" in unknown.error  # never sent
    assert submitted.name == "submit_answer" and sample.status == "completed"
    received = env_calls(log)[seen:]
    assert [c["tool"] for c in received] == ["calculator", "submit_answer"]
    assert received[-1]["done"] and sample.reward == received[-1]["reward"] == 0.0  # text wrong


@needs_openenv
async def test_an_env_server_that_is_down_or_errs_fails_the_sample_naming_url_and_cause(
    env_server, local_engine, tiny_tokenizer
):
    url, _ = env_server
    _, engine = local_engine
    dead = f"http://127.0.0.1:{find_free_port()}"
    with pytest.raises(OpenEnvError, match=rf"{dead}: the OpenEnv server does not answer GET "
                                           r"/health: ConnectError.*\(start it"):  # fmt: skip
        await check_server(dead)
    ctx = make_ctx(engine, tiny_tokenizer)
    prompt = task_prompt(tiny_tokenizer, url, "test", 0)
    down = openenv_generate(OpenEnvConfig(url=dead), dead, parser=scripted())
    samples = await down(prompt, 2, ctx)
    assert [s.status for s in samples] == ["failed", "failed"]
    assert samples[0].error.startswith(f"{dead}: cannot open a session at {dead}/ws: OSError")
    assert "ConnectionRefusedError" in samples[0].error
    server, _ = local_engine  # an HTTP server, but not an OpenEnv one
    with pytest.raises(OpenEnvError, match=rf"refused the WebSocket at {server.url}/ws \(HTTP 4"
                                           r".*is this an OpenEnv server\?"):  # fmt: skip
        async with open_session(server.url):
            pass
    # an error the server answers (reset of a task that does not exist) is the sample's error
    bad = PromptItem(prompt.prompt_ids, prompt.messages, {"reset": {"split": "test", "index": 999}})
    (sample,) = await openenv_generate(OpenEnvConfig(url=url), url, parser=scripted())(bad, 1, ctx)
    assert sample.status == "failed"
    assert sample.error.startswith(f"{url}: the env server answered reset ")
    assert "no task 999 in split 'test'" in sample.error and "EXECUTION_ERROR" in sample.error
    wrong = OpenEnvConfig(url=url, answer_tool="finish")
    (sample,) = await openenv_generate(wrong, url, parser=scripted())(prompt, 1, ctx)
    assert sample.status == "failed" and sample.error == (
        f"{url}: env.openenv.answer_tool 'finish' is not one of the env's tools "
        "['calculator', 'submit_answer']")  # fmt: skip
    # and through collect_groups, such samples are counted as failed, never trained
    result = await collect_groups(
        GroupSource(lambda: (bad, [])), n_groups=1, n_samples=2, engine=engine,
        sampling_params={"max_new_tokens": 4}, reward_fn=env_reward, group_filter=keep_all,
        generate_fn=openenv_generate(OpenEnvConfig(url=url), url, parser=scripted()),
        limiter=trio.CapacityLimiter(4), sample_retries=1, max_launches=1, tokenizer=tiny_tokenizer,
    )  # fmt: skip
    assert result.accepted == [] and result.n_failed_groups == 1
    assert result.n_retried_samples == 2 and result.n_failed_samples == 2


@needs_openenv
async def test_an_env_server_that_dies_mid_episode_fails_the_sample(local_engine, tiny_tokenizer):
    """Also: `serve_env_app` serves a config-named app on 127.0.0.1 and stops it."""
    _, engine = local_engine
    async with serve_env_app(APP) as served:
        prompt = task_prompt(tiny_tokenizer, served.url, "test", 0)
        proxy = RecordingEngine(engine)

        class KillsTheEnvAtTurn2:
            async def generate(self, input_ids, sampling_params=None, *, rid=None, **kw):
                if len(proxy.calls) == 1:
                    os.killpg(served.pid, signal.SIGKILL)
                return await proxy.generate(input_ids, sampling_params, rid=rid, **kw)

            async def abort(self, rid):
                await engine.abort(rid)

        calc = [ParsedToolCall("calculator", {"expression": "1+1"})]
        generate = openenv_generate(OpenEnvConfig(url=served.url), served.url,
                                    parser=scripted(calc, calc))  # fmt: skip
        (sample,) = await generate(prompt, 1, make_ctx(KillsTheEnvAtTurn2(), tiny_tokenizer))
    assert len(proxy.calls) == 2 and [r.output for r in sample.tool_calls] == ["2"]
    assert sample.status == "failed" and sample.error.startswith("env step raised OpenEnvError: ")
    assert f"{served.url}: the " in sample.error  # the session's server, and what broke


@needs_openenv
async def test_the_openenv_recipe_trains_and_the_env_received_exactly_the_logged_calls(
    tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    from training.recipes.rl import RLExtensions, run_rl_recipe
    from training.rl.dump_audit import audit_rollout_dump
    from training.rl.rollout_dump import read_rollout_dump

    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("OPENENV_CALCULATOR_LOG", str(log))  # the server the recipe starts sees it
    # every token stops a turn: 1-token turns that end (not cut at max_new_tokens), so each
    # one is parsed; the untrained model rarely samples its end-of-turn token by itself
    every_token = ",".join(str(t) for t in range(len(tiny_tokenizer)))
    config = load_config(RLRunConfig, ROOT / "configs" / "openenv_tiny.yaml", [
        f"output_dir={tmp_path / 'out'}", f"model.path={tiny_model_dir}",
        "env.openenv.max_tasks=8", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.filter_groups=none", "rollout.sampling.max_new_tokens=6", "train.max_steps=2",
        "train.eval_samples=2", "train.eval_max_new_tokens=6", "train.dump_rollouts=true",
        f"rollout.sampling.stop_token_ids=[{every_token}]",
    ])  # fmt: skip
    assert config.env.openenv.app == APP  # the recipe serves it on 127.0.0.1 itself

    def parser(text: str) -> list[ParsedToolCall]:  # even: a calculator call; odd: the answer
        return [ParsedToolCall("calculator", {"expression": f"{len(text)}*2"})] \
            if len(text) % 2 == 0 else []  # fmt: skip

    summary = await run_rl_recipe(config, extensions=RLExtensions(tool_parser=parser))
    out = tmp_path / "out"
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary.steps == 2 and [r["step"] for r in rows] == [1, 2]
    assert all(r["samples_failed"] == 0 for r in rows), rows
    batches = read_rollout_dump(out / "rollouts.jsonl")
    samples = [s for b in batches.values() for g in b.groups for s in g]
    assert len(samples) == 2 * 2 * 2
    audit = audit_rollout_dump(out / "rollouts.jsonl", max_lag=0, drawn=[], held=[])
    assert (audit.trained, audit.twice, audit.stale) == (8, 0, 0)
    # every call the trained episodes made reached the env, and nothing else (eval: test-*)
    trained_calls = Counter((s.metadata["id"], r.name, json.dumps(dict(r.arguments)))
                            for s in samples for r in s.tool_calls)  # fmt: skip
    received = Counter((c["task"], c["tool"], json.dumps(c["arguments"]))
                       for c in env_calls(log) if c["task"].startswith("train-"))  # fmt: skip
    assert received == trained_calls and sum(received.values()) >= 8
    assert sum(s.reward for s in samples) == sum(c["reward"] or 0 for c in env_calls(log)
                                                 if c["task"].startswith("train-"))  # fmt: skip
    assert rows[-1]["eval_scored"] == 2 and rows[-1]["eval_failed"] == 0  # held-out episodes


@needs_openenv
async def test_a_run_whose_env_server_is_down_or_does_not_start_stops_before_models_load(
    tiny_model_dir, tmp_path
):
    from training.recipes.rl import run_rl_recipe

    dead = f"http://127.0.0.1:{find_free_port()}"
    base = [
        f"output_dir={tmp_path / 'out'}",
        f"model.path={tiny_model_dir}",
        "env.openenv.app=null",
    ]
    config = load_config(RLRunConfig, ROOT / "configs" / "openenv_tiny.yaml",
                         [*base, f"env.openenv.url={dead}"])  # fmt: skip
    with pytest.raises(OpenEnvError, match=rf"^{dead}: the OpenEnv server does not answer GET "
                                           r"/health: ConnectError.*\(start it, or fix "
                                           r"env.openenv.url\)"):  # fmt: skip
        await run_rl_recipe(config)
    assert not (tmp_path / "out").exists()  # nothing was started or written
    app = "examples.no_such_env:app"
    config = load_config(RLRunConfig, ROOT / "configs" / "openenv_tiny.yaml",
                         [*base, "env.openenv.url=null", f"env.openenv.app={app}"])  # fmt: skip
    with pytest.raises(OpenEnvError, match=rf"env.openenv.app={app} exited with code \d+ before "
                                           r"answering /health; log .* ends with:\n(.|\n)*"
                                           r'Could not import module "examples.no_such_env"'):  # fmt: skip
        await run_rl_recipe(config)


def test_openenv_config_keys_are_checked_with_the_file_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("env:\n  kind: openenv\n  openenv:\n    url: http://127.0.0.1:1\n"
                    "    max_session: 4\n")  # fmt: skip
    with pytest.raises(ConfigError, match=r"bad\.yaml.*env\.openenv\.max_session"):
        load_config(RLRunConfig, path)
    refused = {
        "env.kind=openenv": "env.openenv \\(url or app of the env server\\) goes with env.kind",
        "env.kind=tools,env.openenv.url=http://h:1": "goes with env.kind openenv and only",
        "env.kind=openenv,env.openenv.url=http://h:1,env.openenv.app=m:a": "exactly one",
        "env.kind=openenv,env.openenv.url=h:1": "must start with http",
        "env.kind=openenv,env.openenv.url=http://h:1,env.tools=[python]": "env.tools do not apply",
        "env.kind=openenv,env.openenv.url=http://h:1,env.openenv.train_split=train":
            "set env.openenv.env_name",
    }  # fmt: skip
    for overrides, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            load_config(RLRunConfig, None, overrides.split(","))


def test_the_trainer_never_imports_openenv():
    """The env server needs the `openenv` package (a slow import); the trainer speaks its wire."""
    import training.recipes.rl  # noqa: F401  (everything env.kind openenv runs in the trainer)

    assert not [m for m in sys.modules if m == "openenv" or m.startswith("openenv.")]


@needs_openenv
async def test_a_session_deadline_names_the_url(env_server):
    url, _ = env_server
    with pytest.raises(OpenEnvError, match=rf"{url}: no WebSocket handshake at {url}/ws within"):
        async with open_session(url, timeout_s=1e-9):
            pass
