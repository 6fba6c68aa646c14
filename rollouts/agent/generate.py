"""`agent_generate`: a GenerateFn that trains an agent written for the OpenAI API.

Per prompt group it opens one agent proxy (`rollouts.agent.proxy`) for exactly as long as
the group runs, and runs the harness `n` times concurrently, each against its own session
(GRPO's group = n sessions of one task); the engine requests share the manager's
concurrency limit. Each branch of a session becomes a Sample (exact tokens, masks, logprobs;
`rollouts.agent.trajectory`), with the harness's reward (keep it with `reward_fn=env_reward`,
or leave it None and let the reward function score each sample): the branch its last call
went to stands for the session (`sub_index` 0, one of the group's n), every other branch is an
extra sample of the group (`sub_index` 1, 2, ...), so a group of n sessions may train more
than n samples. A session that failed, was aborted or was cut short gives only its one sample.

Failures are data, never fatal: a harness that raises, exits non-zero, prints no number or
passes `timeout_s`, a bad request body (or one over the size limit), a call the engine refused
with a 4xx (a prompt past the context) and a session that made no call give a failed sample
whose `error` names the cause (counted in `samples_failed` and the error summary, retried
under `rollout.sample_retries` like any failed sample). Any other engine error the agent saw
(no answer, a 5xx) is re-raised after its session, so the pool's failure policy applies as to
any rollout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from plumbing.errors import ConfigError
from rollouts.agent.harness import AgentEndpoint, Harness, HarnessOutcome, run_harness
from rollouts.agent.proxy import AgentSession, SessionLimits, open_agent_proxy
from rollouts.agent.trajectory import Branch
from rollouts.chat_turns import chat_turns_per_tokenizer
from rollouts.generate_fn import GenerateContext, GenerateFn
from rollouts.prompts import PromptItem
from rollouts.tools.base import ToolParser
from rollouts.tools.parsers import parse_hermes_tool_calls
from rollouts.types import Sample, Status


@dataclass(frozen=True)
class AgentConfig:
    """How agent sessions run.

    Attributes:
        timeout_s: wall-clock budget of one harness run (`agent.timeout_s` in configs).
        parser: reads tool calls from sampled text into the answers' `tool_calls`.
        limits: calls and response tokens per session.
        template_kwargs: extra chat-template variables (e.g. `{"enable_thinking": False}`).
    """

    timeout_s: float = 120.0
    parser: ToolParser = parse_hermes_tool_calls
    limits: SessionLimits = field(default_factory=SessionLimits)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"agent.timeout_s must be > 0, got {self.timeout_s}")


def agent_task(prompt: PromptItem) -> dict[str, Any]:
    """What a harness gets: the prompt's messages and metadata (JSON-serialisable)."""
    return {"messages": [dict(m) for m in prompt.messages], "metadata": dict(prompt.metadata)}


def _status(session: AgentSession, branch: Branch | None, outcome: HarnessOutcome
            ) -> tuple[Status, str | None]:  # fmt: skip
    if session.aborted:
        return "aborted", None
    if session.fault is not None:
        return "failed", session.fault
    if outcome.error is not None and not session.truncated:
        return "failed", outcome.error
    if branch is None:
        return "failed", "the agent made no model call (chat/completions, responses or messages)"
    if session.truncated or branch.finish == "length":
        return "truncated", None
    return "completed", None


def branch_sample(session: AgentSession, branch: Branch, prompt: PromptItem, *,
                  status: Status = "completed", error: str | None = None,
                  reward: float | None = None, sub_index: int = 0) -> Sample:  # fmt: skip
    """One branch of a session as a Sample (`index_in_group` = the session's index)."""
    ctx, tok = session.ctx, session.trajectory.chat.tokenizer
    return Sample(
        prompt_ids=branch.prompt_ids, response_ids=branch.ids, loss_mask=branch.mask,
        rollout_logprobs=branch.logprobs if branch.has_logprobs else (),
        response_text=tok.decode(branch.ids, skip_special_tokens=False),
        reward=reward or 0.0, status=status, error=error, group_id=ctx.group_id,
        index_in_group=session.index, sub_index=sub_index,
        weight_version=min((v for *_, v in branch.spans), default=0),
        metadata={**prompt.metadata, "agent_branches": len(session.trajectory.branches),
                  "agent_calls": session.n_calls,
                  "agent_weight_spans": [list(s) for s in branch.spans]},
        tool_calls=tuple(branch.tool_calls), finish_reason=branch.finish,
    )  # fmt: skip


def session_samples(session: AgentSession, prompt: PromptItem) -> list[Sample]:
    """Every branch of a finished session as a Sample (a rewrite of history = a branch)."""
    return [branch_sample(session, b, prompt) for b in session.trajectory.branches]


def session_sample(session: AgentSession, prompt: PromptItem, outcome: HarnessOutcome) -> Sample:
    """The Sample that stands for a session: its last branch, status and reward."""
    branches = session.trajectory.branches
    branch = branches[session.last_branch] if session.last_branch is not None else None
    status, error = _status(session, branch, outcome)
    if branch is None:
        return Sample(prompt_ids=prompt.prompt_ids, response_ids=(), loss_mask=(),
                      status=status, error=error, group_id=session.ctx.group_id,
                      index_in_group=session.index, metadata=prompt.metadata)  # fmt: skip
    return branch_sample(session, branch, prompt, status=status, error=error,
                         reward=outcome.reward)  # fmt: skip


def trained_session_samples(session: AgentSession, prompt: PromptItem, outcome: HarnessOutcome
                            ) -> list[Sample]:  # fmt: skip
    """What a session trains as: `session_sample`, then each other branch (module docstring).

    The other branches come only from a session that ended well (completed or truncated): a
    failed or aborted session is retried or held as one sample, never half-kept. Each carries
    the session's reward.
    """
    main = session_sample(session, prompt, outcome)
    if main.status not in ("completed", "truncated"):
        return [main]
    others = [b for i, b in enumerate(session.trajectory.branches) if i != session.last_branch]
    return [main] + [
        branch_sample(session, b, prompt, reward=outcome.reward, sub_index=k,
                      status="truncated" if b.finish == "length" else "completed")
        for k, b in enumerate(others, start=1)
    ]  # fmt: skip


def agent_generate(harness: Harness, *, tokenizer: Any = None,
                   config: AgentConfig = AgentConfig()) -> GenerateFn:  # fmt: skip
    """A GenerateFn running `n` concurrent sessions of `harness` per prompt (module docstring).

    Args:
        harness: `python_harness(agent)`, `subprocess_harness(argv)` or any `Harness`.
        tokenizer: the policy's tokenizer (default: the one in the GenerateContext).
        config: deadline, tool-call parser, session limits, template variables.

    Raises (from the returned function):
        ConfigError: no tokenizer was given either way.
        EngineError: an engine request of a session failed.
    """
    chat_for = chat_turns_per_tokenizer("agent_generate", config.template_kwargs)

    async def generate(prompt: PromptItem, n: int, ctx: GenerateContext) -> list[Sample]:
        chat = chat_for(tokenizer if tokenizer is not None else ctx.tokenizer)
        out: list[list[Sample]] = [[] for _ in range(n)]
        task = agent_task(prompt)
        async with open_agent_proxy(chat, parser=config.parser) as proxy:

            async def one(i: int) -> None:
                session = proxy.open_session(ctx, i, config.limits)
                try:
                    endpoint = AgentEndpoint(session.base_url, session.api_key)
                    outcome = await run_harness(harness, endpoint, task, config.timeout_s)
                finally:
                    proxy.close_session(session)
                if session.engine_error is not None:
                    raise session.engine_error
                out[i] = trained_session_samples(session, prompt, outcome)
                for sample in out[i]:
                    ctx.report(sample)

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
        return [s for samples in out for s in samples]

    return generate
