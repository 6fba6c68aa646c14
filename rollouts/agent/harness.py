"""Harnesses: how an agent program is run against its session's base URL and key.

A `Harness` is one plain async callable, `(endpoint, task) -> reward | None`; two makers
cover the usual cases:

- `python_harness(agent)`: `agent(client, task)` gets an `openai.AsyncOpenAI` pointed at the
  session (no retries: a failed call is the agent's to handle or to fail on);
- `subprocess_harness(argv)`: any program, in any language, run with `OPENAI_BASE_URL` and
  `OPENAI_API_KEY` set (and `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY` for the same session,
  for the `anthropic` client), the task as JSON on stdin and its reward as the last line of
  stdout (empty or `null`: no reward, the rollout's reward function decides).

`run_harness` runs one under a deadline and turns every way it can fail (it raises, the
program exits non-zero or prints no number, the deadline passes) into a `HarnessOutcome` with
the cause; it never raises for the harness's faults. On the deadline the harness is
cancelled; a subprocess is sent SIGTERM, then SIGKILL after 5 s (trio's `run_process`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import trio

from plumbing.errors import ConfigError, RolloutsError


class HarnessError(RolloutsError, RuntimeError):
    """An agent program failed (exit status, unreadable reward); the message says how."""


@dataclass(frozen=True)
class AgentEndpoint:
    """Where a session's agent calls: the OpenAI base URL (ends in `/v1`) and its API key."""

    base_url: str
    api_key: str

    @property
    def anthropic_base_url(self) -> str:
        """The same session for the `anthropic` client, which appends `/v1/messages` itself."""
        return self.base_url.removesuffix("/").removesuffix("/v1")


Harness: TypeAlias = Callable[[AgentEndpoint, Mapping[str, Any]], Awaitable[float | None]]
"""async (endpoint, task) -> reward, or None to leave the reward to the rollout's reward_fn."""

OpenAIAgent: TypeAlias = Callable[[Any, Mapping[str, Any]], Awaitable[float | None]]
"""async (openai.AsyncOpenAI client, task) -> reward | None: an agent written for the API."""


@dataclass(frozen=True)
class HarnessOutcome:
    reward: float | None
    error: str | None = None  # why the harness failed (its sample fails)


def python_harness(agent: OpenAIAgent, *, request_timeout_s: float = 600.0) -> Harness:
    """A Harness running `agent(client, task)` with an `openai.AsyncOpenAI` client.

    Raises (when called):
        ConfigError: the `openai` package is not installed (`pip install openai`).
    """

    async def run(endpoint: AgentEndpoint, task: Mapping[str, Any]) -> float | None:
        try:
            import openai
        except ImportError as err:
            raise ConfigError("python_harness needs the openai package: pip install openai") \
                from err  # fmt: skip
        # The session is plain HTTP on loopback: no CA bundle to load (that costs ~100 ms of
        # CPU per client, seconds per RL step at 128 sessions) and no proxy from the env.
        http = openai.DefaultAsyncHttpxClient(verify=False, trust_env=False)
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                                    max_retries=0, timeout=request_timeout_s,
                                    http_client=http)  # fmt: skip
        async with client:
            return await agent(client, task)

    return run


def read_reward(stdout: bytes, argv0: str) -> float | None:
    """The reward a subprocess printed: its last non-empty line, a number, `null` or nothing.

    Raises:
        HarnessError: the last line is not a finite number.
    """
    lines = [line.strip() for line in stdout.decode(errors="replace").splitlines() if line.strip()]
    if not lines or lines[-1].lower() in ("null", "none"):
        return None
    try:
        reward = float(lines[-1])
    except ValueError:
        raise HarnessError(f"{argv0}: the last line of stdout must be the reward (a number or "
                           f"null), got {lines[-1][:120]!r}") from None  # fmt: skip
    if not math.isfinite(reward):
        raise HarnessError(f"{argv0}: the reward must be finite, got {lines[-1]!r}")
    return reward


def subprocess_harness(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                       cwd: str | None = None) -> Harness:  # fmt: skip
    """A Harness running `argv` with the session in `OPENAI_BASE_URL` / `OPENAI_API_KEY` (and
    `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY`), the task as JSON on stdin and the reward read
    from stdout (`read_reward`)."""
    if not argv:
        raise ConfigError("subprocess_harness: argv is empty")
    command = [str(a) for a in argv]

    async def run(endpoint: AgentEndpoint, task: Mapping[str, Any]) -> float | None:
        environ = {**os.environ, **dict(env or {}), "OPENAI_BASE_URL": endpoint.base_url,
                   "OPENAI_API_KEY": endpoint.api_key,
                   "ANTHROPIC_BASE_URL": endpoint.anthropic_base_url,
                   "ANTHROPIC_API_KEY": endpoint.api_key}  # fmt: skip
        done = await trio.run_process(command, stdin=json.dumps(dict(task)).encode(),
                                      capture_stdout=True, capture_stderr=True, check=False,
                                      env=environ, cwd=cwd)  # fmt: skip
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip()[-400:]
            raise HarnessError(f"{command[0]} exited with status {done.returncode}: {tail}")
        return read_reward(done.stdout, command[0])

    return run


async def run_harness(harness: Harness, endpoint: AgentEndpoint, task: Mapping[str, Any],
                      timeout_s: float) -> HarnessOutcome:  # fmt: skip
    """Run `harness` under `timeout_s`; its failures come back as data (see module docstring).

    Cancellation from outside (an aborted rollout) still propagates.
    """
    with trio.move_on_after(timeout_s) as scope:
        try:
            reward = await harness(endpoint, task)
        except Exception as exc:  # a broken agent fails its sample, never the run
            return HarnessOutcome(None, f"agent raised {type(exc).__name__}: {str(exc)[:300]}")
    if scope.cancelled_caught:
        return HarnessOutcome(None, f"agent timed out after {timeout_s:g} s")
    if reward is not None and not isinstance(reward, int | float):
        return HarnessOutcome(None, f"agent returned {type(reward).__name__}, not a number")
    return HarnessOutcome(None if reward is None else float(reward))
