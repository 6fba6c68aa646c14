"""Exact token trajectories rebuilt from an agent's chat calls: prefix extension and branches.

Pure (tokenizer only). A session's calls are matched against its branches: a call whose
messages are a branch's messages so far plus the answer the proxy gave (compared as role,
content and tool calls; tool-call ids aside) *extends* that branch, and its prompt is the
branch's ids + the rest of the turn close + the new messages and the next assistant header as
the template renders them after an assistant turn (`ChatTurns.appended_ids`). Text the model
produced is never re-tokenized. Any other call (a first call, or one that rewrote history:
edited, dropped or summarised turns, other tools, or a history the chat template itself
renders differently once the new messages follow, as Qwen3's does with earlier reasoning)
starts a new branch from the template's rendering of all its messages; each branch is its own
sample.

Guarantees (as `rollouts.multiturn`): `prompt_ids + response_ids` of a branch is, token for
token, its last request plus the sampled output; `loss_mask` is 1 exactly on sampled tokens;
`rollout_logprobs` are the engine's on sampled tokens and 0.0 on appended ones; each sampled
span keeps the weight version(s) that produced it. Two calls that extend the same branch at
once (an agent fanning out) fork it: the second becomes a new branch that shares the prefix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollouts.agent.openai_shapes import canonical
from rollouts.chat_turns import ChatTurns
from rollouts.prompts import encode_prompt
from rollouts.types import ToolCallRecord

Span = tuple[int, int, int]  # [start, end) in the response, weight version


@dataclass
class Branch:
    """One trajectory of a session (mutable while the session runs)."""

    prompt_ids: tuple[int, ...]
    tools_key: str
    history: list[tuple[Any, ...]] = field(default_factory=list)  # canonical messages + answers
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    has_logprobs: bool = True
    spans: list[Span] = field(default_factory=list)
    last_output: tuple[int, ...] = ()
    finish: str | None = None
    n_calls: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    tool_calls_at: list[int] = field(default_factory=list)  # len(history) before each record
    pending_calls: list[Mapping[str, Any]] = field(default_factory=list)  # last answer's calls

    def fork(self, n_ids: int, n_history: int) -> Branch:
        """A new branch with this one's first `n_ids` response ids and `n_history` messages,
        and only the tool-call records made before that point (a record made by a later call
        of this branch belongs to tokens the fork does not have)."""
        kept = [j for j, at in enumerate(self.tool_calls_at) if at < n_history]
        return Branch(self.prompt_ids, self.tools_key, self.history[:n_history],
                      self.ids[:n_ids], self.mask[:n_ids], self.logprobs[:n_ids],
                      self.has_logprobs, [s for s in self.spans if s[1] <= n_ids],
                      self.last_output, self.finish, self.n_calls,
                      [self.tool_calls[j] for j in kept], [self.tool_calls_at[j] for j in kept])  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Where a call's tokens go: the request ids, and the branch state they extend."""

    input_ids: tuple[int, ...]
    branch: int | None  # None: a new branch
    appended: tuple[int, ...]  # template tokens added before sampling (mask 0)
    base_ids: int  # len(branch.ids) when planned
    base_history: int
    pending_calls: tuple[Mapping[str, Any], ...] = ()  # the branch's last answer's tool calls


def _tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    return json.dumps(list(tools or ()), sort_keys=True)


class SessionTrajectory:
    """The branches of one agent session (not thread-safe; one trio task at a time)."""

    def __init__(self, chat: ChatTurns) -> None:
        self.chat = chat
        self.branches: list[Branch] = []

    def plan(self, messages: Sequence[Mapping[str, Any]],
             tools: Sequence[Mapping[str, Any]] | None) -> Plan:  # fmt: skip
        """The request ids for a call with `messages` (see the module docstring).

        A call that extends a branch whose history the template renders differently once the
        new messages follow (`ChatTurns.appended_ids` is None: Qwen3's template drops earlier
        reasoning) starts a new branch too.
        """
        key, canon = _tools_key(tools), [canonical(m) for m in messages]
        best = None
        for i, branch in enumerate(self.branches):
            n = len(branch.history)
            if branch.tools_key == key and branch.n_calls and canon[:n] == branch.history \
                    and len(canon) >= n and (best is None or n > len(self.branches[best].history)):  # fmt: skip
                best = i
        appended = None
        if best is not None:
            n = len(self.branches[best].history)
            new, history = [dict(m) for m in messages[n:]], [dict(m) for m in messages[:n]]
            appended = self.chat.appended_ids(self.branches[best].last_output, new,
                                              list(tools) if tools else None, history=history)  # fmt: skip
        if best is None or appended is None:  # a first call, a rewrite, or a re-rendered history
            ids = encode_prompt(self.chat.tokenizer, list(messages), list(tools) if tools else None,
                                template_kwargs=self.chat.template_kwargs)  # fmt: skip
            return Plan(tuple(ids), None, (), 0, 0)
        branch = self.branches[best]
        return Plan((*branch.prompt_ids, *branch.ids, *appended), best, tuple(appended),
                    len(branch.ids), len(branch.history), tuple(branch.pending_calls))  # fmt: skip

    def response_len(self, plan: Plan) -> int:
        """Response tokens the branch will hold before this call samples (for budgets)."""
        return 0 if plan.branch is None else plan.base_ids + len(plan.appended)

    def record(self, plan: Plan, messages: Sequence[Mapping[str, Any]], answer: Mapping[str, Any],
               output_ids: Sequence[int], logprobs: Sequence[float] | None,
               versions: Sequence[Span], finish: str, tools: Any) -> int:  # fmt: skip
        """Add a call's sampled tokens to its branch; returns the branch index.

        `versions`: (start, end, weight version) spans over `output_ids`.
        """
        if plan.branch is None:
            branch = Branch(plan.input_ids, _tools_key(tools))
            self.branches.append(branch)
            index = len(self.branches) - 1
        else:
            branch = self.branches[plan.branch]
            index = plan.branch
            if len(branch.ids) != plan.base_ids:  # extended meanwhile by a concurrent call
                branch = branch.fork(plan.base_ids, plan.base_history)
                self.branches.append(branch)
                index = len(self.branches) - 1
            # The calls answered are those of the branch as planned: a sibling recorded since
            # (a fork) has its own last answer.
            records = _tool_records(plan.pending_calls, messages[plan.base_history :])
            branch.tool_calls += records
            branch.tool_calls_at += [plan.base_history] * len(records)
            branch.ids += plan.appended
            branch.mask += [0] * len(plan.appended)
            branch.logprobs += [0.0] * len(plan.appended)
        start = len(branch.ids)
        branch.ids += output_ids
        branch.mask += [1] * len(output_ids)
        if logprobs is None or len(logprobs) != len(output_ids):
            branch.has_logprobs = False
            branch.logprobs += [0.0] * len(output_ids)
        else:
            branch.logprobs += logprobs
        branch.spans += [(start + a, start + b, v) for a, b, v in versions]
        branch.history = [canonical(m) for m in messages] + [canonical(answer)]
        branch.last_output, branch.finish = tuple(output_ids), finish
        branch.pending_calls = list(answer.get("tool_calls") or ())
        branch.n_calls += 1
        return index


def _tool_records(calls: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]
                  ) -> list[ToolCallRecord]:  # fmt: skip
    """The agent's tool results for the proxy's last tool calls, as records for tool metrics.

    A result is matched by `tool_call_id`, else by order; `success` is read from the text (a
    result starting with "Error" failed, as `rollouts.tools` writes failures): the proxy does
    not run the tools, so this is the agent's word.
    """
    results = [m for m in new if m.get("role") == "tool"]
    by_id = {m.get("tool_call_id"): m for m in results if m.get("tool_call_id")}
    out = []
    for j, call in enumerate(calls):
        result = by_id.get(call.get("id")) or (results[j] if j < len(results) else None)
        if result is None:
            continue
        text = result.get("content") or ""
        out.append(ToolCallRecord(call["function"]["name"], call["function"]["arguments"], text,
                                  success=not text.lstrip().startswith("Error")))  # fmt: skip
    return out
