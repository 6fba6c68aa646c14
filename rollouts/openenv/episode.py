"""Episodes in an OpenEnv MCP tool environment, as rollouts' multi-turn `Env` and `GenerateFn`.

One episode = one WebSocket session at the env server (its own environment instance):
`reset(**prompt.metadata["reset"])`, then `list_tools` — the listed tools become the chat
template's tools. Each model turn's tool calls (read by the project's tool-call parser) are
sent as `call_tool` actions, one after another; each observation becomes a tool message. The
environment's `reward` (summed over the episode) and `done` end it. A turn without tool calls
is sent as a call of `answer_tool` when one is configured (an env that grades answers through
a submit tool); otherwise it ends the episode with the rewards given so far. Tokens, masks and
limits are `rollouts.multiturn.run_episode`'s: exactly what the engine sampled is trained.

Failures: a call the model got wrong (malformed, unknown tool, bad arguments, a tool error the
env reports) is a failed tool result the model reads, as in `ToolEnv`. The env server itself
failing (unreachable, an error frame, a closed connection, no answer within `step_timeout_s`)
fails the sample, with the URL and the cause as its error: it is retried under
`rollout.sample_retries` and then its group dropped, like any failed sample.

Not supported: environments whose actions are not MCP tool calls (no tools listed: refused
with the URL), OpenEnv's production mode (`/mcp` only, no rewards), reset observations as the
prompt (the prompt is the record's messages: prompt files or the env's task provider).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from rollouts.chat_turns import ChatTurns, chat_turns_per_tokenizer
from rollouts.envs import ModelTurn, Observation, StepResult
from rollouts.generate_fn import GenerateContext, GenerateFn
from rollouts.multiturn import MultiTurnConfig, run_episode
from rollouts.openenv.config import OpenEnvConfig
from rollouts.openenv.wire import OpenEnvError, OpenEnvSession, open_session
from rollouts.prompts import PromptItem
from rollouts.tools.base import (
    ParsedToolCall,
    Tool,
    ToolError,
    ToolParser,
    ToolResult,
    execute_tool_calls,
    tool_message,
)
from rollouts.types import Sample


def tool_text(observation: Mapping[str, Any]) -> tuple[str, str | None]:
    """(result text, error or None) of a `call_tool` observation (an MCP CallToolResult)."""
    error = observation.get("error")
    if error:
        return "", str(error.get("message", error) if isinstance(error, dict) else error)
    result = observation.get("result")
    if isinstance(result, dict):
        texts = [c.get("text", "") for c in result.get("content") or () if c.get("type") == "text"]
        text = "\n".join(texts) if texts else json.dumps(result.get("data"))
        return text, (text or "the tool reported an error") if result.get("is_error") else None
    return ("" if result is None else str(result)), None


def tool_spec(tool: Mapping[str, Any]) -> dict[str, Any]:
    """An MCP tool listing (name, description, input_schema) as a chat-template function spec."""
    schema = dict(tool.get("input_schema") or tool.get("inputSchema") or {"type": "object"})
    return {"type": "function", "function": {"name": tool["name"],
            "description": tool.get("description") or "", "parameters": schema}}  # fmt: skip


@dataclass
class OpenEnvEpisode:
    """One episode over an open session (a rollouts `Env`; see the module docstring)."""

    session: OpenEnvSession
    prompt: PromptItem
    config: OpenEnvConfig
    parser: ToolParser
    system_prompt: str | None = None
    show_specs: bool = True

    def __post_init__(self) -> None:
        self.tools: dict[str, Tool] = {}
        self.done = False
        self.fault: OpenEnvError | None = None
        self._reward = 0.0
        self._first: Observation | None = None

    async def initial_observation(self) -> Observation:
        return self._first if self._first is not None else await self.start()

    async def start(self) -> Observation:
        """Reset the environment and list its tools: the episode's first observation.

        Raises:
            OpenEnvError: the server failed, or it listed no usable tools.
        """
        reset = self.prompt.metadata.get("reset") or {}
        if not isinstance(reset, Mapping):
            raise OpenEnvError(f"prompt {self.prompt.source or '?'}: metadata.reset must be an "
                               f"object of reset() arguments, got {reset!r}")  # fmt: skip
        await self.session.reset(**reset)
        listed = (await self.session.step({"type": "list_tools"})).get("observation") or {}
        if not listed.get("tools"):
            raise OpenEnvError(
                f"{self.session.url}: list_tools gave no tools "
                f"({listed.get('metadata') or 'not an MCP tool environment?'}): env.kind "
                "openenv drives MCP tool environments (MCPEnvironment) only"
            )
        specs = [tool_spec(t) for t in listed["tools"]]
        budget = self.config.step_timeout_s + 5.0  # the session's own deadline comes first
        try:
            self.tools = {f["name"]: Tool(f["name"], f["description"], f["parameters"],
                                          self._executor(f["name"]), timeout_s=budget)
                          for f in (s["function"] for s in specs)}  # fmt: skip
        except ValueError as exc:  # a name or schema rollouts' tool calls cannot carry
            raise OpenEnvError(f"{self.session.url}: list_tools: {exc}") from exc
        answer = self.config.answer_tool
        if answer is not None and answer not in self.tools:
            raise OpenEnvError(f"{self.session.url}: env.openenv.answer_tool {answer!r} is not one "
                               f"of the env's tools {sorted(self.tools)}")  # fmt: skip
        messages = tuple(self.prompt.messages)
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages = ({"role": "system", "content": self.system_prompt}, *messages)
        self._first = Observation(messages, tools=tuple(specs) if self.show_specs else None)
        return self._first

    def _executor(self, name: str):
        async def call(arguments: Mapping[str, Any]) -> ToolResult:
            if self.done:
                raise ToolError("not run: the environment ended the episode")
            try:
                answer = await self.session.step({"type": "call_tool", "tool_name": name,
                                                   "arguments": dict(arguments)})  # fmt: skip
            except OpenEnvError as exc:
                self.fault = exc  # the env server failed, not the model: the sample fails
                raise
            self._reward += float(answer.get("reward") or 0.0)
            self.done = self.done or bool(answer.get("done"))
            text, error = tool_text(answer.get("observation") or {})
            return ToolResult(text, success=error is None, error=error)

        return call

    async def step(self, turn: ModelTurn) -> StepResult:
        calls = [] if turn.truncated else self.parser(turn.text)
        if turn.truncated or (not calls and self.config.answer_tool is None):
            return StepResult(0.0, done=True, metrics={"env_done": 0.0})
        if not calls:
            calls = [ParsedToolCall(self.config.answer_tool,
                                    {self.config.answer_argument: turn.text})]  # fmt: skip
        before = self._reward
        records = await execute_tool_calls(calls, self.tools,
                                           max_calls=self.config.max_calls_per_turn,
                                           max_output_chars=self.config.max_output_chars)  # fmt: skip
        if self.fault is not None:
            raise self.fault
        return StepResult(self._reward - before, done=self.done,
                          messages=tuple(tool_message(r) for r in records),
                          metrics={"env_done": float(self.done)}, tool_calls=tuple(records))  # fmt: skip


def failed_sample(prompt: PromptItem, index: int, ctx: GenerateContext, error: str) -> Sample:
    """The sample of an episode whose session could not start (nothing was sampled)."""
    return Sample(prompt_ids=prompt.prompt_ids, response_ids=(), loss_mask=(), status="failed",
                  error=error, group_id=ctx.group_id, index_in_group=index,
                  metadata=dict(prompt.metadata))  # fmt: skip


def openenv_generate(config: OpenEnvConfig, url: str, *, parser: ToolParser,
                     system_prompt: str | None = None, show_specs: bool = True,
                     multiturn: MultiTurnConfig | None = None,
                     tokenizer: Any = None) -> GenerateFn:  # fmt: skip
    """A GenerateFn running `n` concurrent episodes per prompt at the env server at `url`.

    Each episode holds one of `config.max_sessions` session slots (the server's
    `max_concurrent_envs` refuses more). Pass `env_reward` as the reward to keep the env's.
    `multiturn`: turn and token limits (default `MultiTurnConfig()`).

    Raises (from the returned function):
        ConfigError: no tokenizer was given either way.
    """
    sessions = trio.CapacityLimiter(config.max_sessions)
    multiturn = multiturn or MultiTurnConfig()
    chat_for = chat_turns_per_tokenizer("openenv_generate", multiturn.template_kwargs)

    async def episode(prompt: PromptItem, i: int, ctx: GenerateContext, chat: ChatTurns) -> Sample:
        async with sessions:
            try:
                async with open_session(url, timeout_s=config.step_timeout_s) as session:
                    env = OpenEnvEpisode(session, prompt, config, parser, system_prompt,
                                         show_specs)  # fmt: skip
                    await env.start()  # here: run_episode lets initial_observation's errors out
                    return await run_episode(env, ctx, chat, index=i, metadata=prompt.metadata,
                                             config=multiturn)  # fmt: skip
            except OpenEnvError as exc:  # the session did not open, or reset / list_tools failed
                return failed_sample(prompt, i, ctx, str(exc))

    async def generate(prompt: PromptItem, n: int, ctx: GenerateContext) -> list[Sample]:
        chat = chat_for(tokenizer if tokenizer is not None else ctx.tokenizer)
        out: list[Sample | None] = [None] * n

        async def one(i: int) -> None:
            out[i] = await episode(prompt, i, ctx, chat)
            ctx.report(out[i])

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        return [s for s in out if s is not None]

    return generate


def task_records(tasks: Sequence[Any], split: str, prompt_key: str) -> list[dict[str, Any]]:
    """Prompt records (rollouts' prompt JSONL shape) of a split's task specs: the user message
    is `task[prompt_key]`; `reset` selects the task (`reset(split=..., index=...)`, OpenEnv's
    Task API convention); the other task fields are metadata (e.g. `answer`, for graders).

    Raises:
        OpenEnvError: a task is not an object or has no string `prompt_key`.
    """
    records = []
    for index, task in enumerate(tasks):
        if not isinstance(task, Mapping) or not isinstance(task.get(prompt_key), str):
            raise OpenEnvError(
                f"task {index} of split {split!r} has no string field {prompt_key!r} (got "
                f"{str(task)[:200]}): set env.openenv.prompt_key to the field holding the prompt"
            )
        meta = {k: v for k, v in task.items() if k not in (prompt_key, "messages", "reset")}
        records.append({"messages": [{"role": "user", "content": task[prompt_key]}], **meta,
                        "reset": {"split": split, "index": index}})  # fmt: skip
    return records
