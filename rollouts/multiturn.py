"""Multi-turn rollouts over an `Env`, token in / token out, as a drop-in `GenerateFn`.

One episode: the env's initial observation is rendered once by the chat template; then, per
turn, the engine continues the token ids so far, the env answers the decoded turn (e.g. runs
the tool calls in it), and the env's messages are appended as tokens until the env says done,
the stop condition holds, `max_turns` is reached or the token budget is spent.

Branches: a chat template that renders the history differently once more messages follow
(Qwen3's drops earlier reasoning and the empty think block of a turn that is no longer last)
cannot be extended after such a turn (`ChatTurns.appended_ids` is None). The next turn then
starts a *branch*: a new sample whose prompt is the template's rendering of the whole history,
while the earlier branch keeps its own sampled tokens. An episode gives one sample per branch
(`run_episode_samples`); with a prefix-stable template that is one.

Guarantees (per branch):
- The ids are extended with exactly what the engine sampled and with the tokenized appended
  segment only (`ChatTurns.appended_ids`); the history is never re-tokenized from text within
  a branch. So `prompt_ids + response_ids` is, token for token, the branch's last request plus
  its output.
- `loss_mask` is 1 exactly on sampled tokens, 0 on appended ones (whose `rollout_logprobs` are
  0.0 placeholders; all empty if the engine returned no logprobs).
- Each engine request holds one `ctx.limiter` token and is listed in `ctx.in_flight` under rid
  `{rid_prefix}-{sample}-t{turn}`, so surplus aborts and pause-with-abort reach it; an aborted
  request ends the episode with status "aborted". Tools run without holding the limiter.
- A failing env step (a bug: tools themselves never raise) marks the sample failed; engine
  errors propagate, for `collect_groups`' policy to handle.

Status: "completed" when the env said done (or the stop condition held), "truncated" when a
turn hit its length limit, the token budget ran out or `max_turns` passed without an end.
`response_text` is the whole decoded response (model and env turns, special tokens kept);
`weight_version` is the oldest version that sampled any turn of the branch.

Not covered: batching several episodes' turns into one `/generate` call (each episode sends
its own requests; the engine still batches them dynamically).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import trio

from plumbing.errors import ConfigError
from rollouts.chat_turns import ChatTurns, chat_turns_per_tokenizer
from rollouts.envs import Env, EnvFactory, ModelTurn, StepResult
from rollouts.generate_fn import GenerateContext, GenerateFn
from rollouts.prompts import PromptItem, encode_prompt
from rollouts.request_ids import oldest_version, request_rid
from rollouts.types import Sample, Status, ToolCallRecord

StopCondition: TypeAlias = Callable[[Sequence[Mapping[str, Any]]], bool]
"""(messages so far, ending with the latest assistant turn) -> stop the episode now."""


@dataclass(frozen=True)
class MultiTurnConfig:
    """Limits of one episode.

    Attributes:
        max_turns: model turns at most.
        max_response_tokens: budget for all response tokens (sampled and appended); each
            turn's `max_new_tokens` is capped to what is left. None: no budget.
        stop_condition: checked after each env step; True ends the episode as completed.
        template_kwargs: extra chat-template variables for every rendering of the episode
            (e.g. `{"enable_thinking": False}`; see rollouts/thinking.py).
    """

    max_turns: int = 8
    max_response_tokens: int | None = None
    stop_condition: StopCondition | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_response_tokens is not None and self.max_response_tokens < 1:
            raise ConfigError(f"max_response_tokens must be >= 1, got {self.max_response_tokens}")


class _Branch:
    """One trajectory of an episode (local, mutable; frozen into a Sample at the end)."""

    def __init__(self, prompt_ids: tuple[int, ...]) -> None:
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.has_logprobs = True
        self.versions: list[int] = []
        self.records: list[ToolCallRecord] = []
        self.finish: str | None = None

    def add_sampled(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.ids += ids
        self.mask += [1] * len(ids)
        if logprobs is None or len(logprobs) != len(ids):
            self.has_logprobs = False
        else:
            self.logprobs += logprobs

    def add_appended(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)


def _turn_params(params: Mapping[str, Any], budget: int | None, used: int) -> dict[str, Any] | None:
    """Sampling params for the next turn, `max_new_tokens` capped to the budget left."""
    out = dict(params)
    if budget is None:
        return out
    left = budget - used
    if left <= 0:
        return None
    out["max_new_tokens"] = min(int(out.get("max_new_tokens", left)), left)
    if "min_new_tokens" in out:  # SGLang rejects min_new_tokens > max_new_tokens
        out["min_new_tokens"] = min(int(out["min_new_tokens"]), out["max_new_tokens"])
    return out


async def generate_turn(ctx: GenerateContext, ids: Sequence[int], params: Mapping[str, Any],
                        rid: str):  # fmt: skip
    """One model turn at `ctx.engine`, holding a `ctx.limiter` token and listed in
    `ctx.in_flight` under `rid` (so surplus aborts reach it). Also the agent proxy's call."""
    async with ctx.limiter:
        ctx.in_flight.add(rid)
        try:
            return await ctx.engine.generate(list(ids), params, rid=rid)
        finally:
            ctx.in_flight.discard(rid)


async def run_episode_samples(
    env: Env,
    ctx: GenerateContext,
    chat: ChatTurns,
    *,
    index: int = 0,
    metadata: Mapping[str, Any] | None = None,
    config: MultiTurnConfig = MultiTurnConfig(),
) -> list[Sample]:
    """Run one episode of `env` on `ctx.engine`: its branches as Samples (module docstring).

    The last branch stands for the episode (`sub_index` 0, the episode's status and all its
    tool-call records); earlier branches follow (`sub_index` 1, 2, ..., completed, no records),
    each with the episode's reward. A failed or aborted episode gives its last branch only.

    Raises:
        EngineError: an engine request failed.
    """
    obs = await env.initial_observation()
    if obs.prompt_ids is not None:
        prompt_ids = tuple(obs.prompt_ids)
    else:
        prompt_ids = tuple(encode_prompt(chat.tokenizer, list(obs.messages), obs.tools,
                                         template_kwargs=chat.template_kwargs))  # fmt: skip
    messages = [dict(m) for m in obs.messages]
    branches = [_Branch(prompt_ids)]
    budget = config.max_response_tokens
    reward, components = 0.0, {}
    status: Status = "truncated"
    error: str | None = None
    for turn in range(config.max_turns):
        branch = branches[-1]
        # the budget counts every token after the episode's first prompt, in whichever branch
        used = len(branch.prompt_ids) - len(prompt_ids) + len(branch.ids)
        params = _turn_params(ctx.sampling_params, budget, used)
        if params is None:
            break
        rid = request_rid(ctx.rid_prefix, index, f"t{turn}")
        result = await generate_turn(ctx, branch.prompt_ids + tuple(branch.ids), params, rid)
        branch.finish = finish = result.finish_reason.type
        branch.versions.append(oldest_version(result))
        branch.add_sampled(result.output_ids, result.output_logprobs)
        if finish == "abort":
            status = "aborted"
            break
        text = chat.decode_turn(result.output_ids)
        messages.append({"role": "assistant", "content": text})
        try:
            step: StepResult = await env.step(ModelTurn(text, result.output_ids, finish, turn))
        except Exception as exc:
            status, error = "failed", f"env step raised {type(exc).__name__}: {exc}"
            break
        reward += step.reward
        components.update(step.metrics)
        branch.records += step.tool_calls
        if finish == "length":
            break
        if step.done or (config.stop_condition is not None and config.stop_condition(messages)):
            status = "completed"
            break
        if turn + 1 == config.max_turns:
            break  # nobody would answer the env's messages
        new = [dict(m) for m in step.messages]
        appended = chat.appended_ids(result.output_ids, new, obs.tools, history=messages)
        messages += new
        if appended is None:  # the template re-renders the history: the next turn branches
            branch = _Branch(tuple(encode_prompt(chat.tokenizer, messages, obs.tools,
                                                 template_kwargs=chat.template_kwargs)))  # fmt: skip
            if budget is not None and len(branch.prompt_ids) - len(prompt_ids) >= budget:
                break  # no room left for the model to answer
            branches.append(branch)
        else:
            if budget is not None and used + len(result.output_ids) + len(appended) >= budget:
                break  # no room left for the model to answer
            branch.add_appended(appended)

    def sample(b: _Branch, sub_index: int, status: Status, error: str | None = None,
               records: Sequence[ToolCallRecord] = ()) -> Sample:  # fmt: skip
        return Sample(
            prompt_ids=b.prompt_ids,
            response_ids=b.ids,
            loss_mask=b.mask,
            rollout_logprobs=b.logprobs if b.has_logprobs else (),
            response_text=chat.tokenizer.decode(b.ids, skip_special_tokens=False),
            reward=reward,
            reward_components=dict(components),
            status=status,
            error=error,
            group_id=ctx.group_id,
            index_in_group=index,
            sub_index=sub_index,
            weight_version=min(b.versions, default=0),
            metadata=dict(metadata or {}),
            tool_calls=tuple(records),
            finish_reason=b.finish,
        )

    # The episode's tool calls go on the sample that stands for it (what evaluation and a
    # tool-use reward read), once: the earlier branches carry none.
    main = sample(branches[-1], 0, status, error, [r for b in branches for r in b.records])
    if status not in ("completed", "truncated"):
        return [main]
    return [main, *(sample(b, k, "completed") for k, b in enumerate(branches[-2::-1], start=1))]


async def run_episode(
    env: Env,
    ctx: GenerateContext,
    chat: ChatTurns,
    *,
    index: int = 0,
    metadata: Mapping[str, Any] | None = None,
    config: MultiTurnConfig = MultiTurnConfig(),
) -> Sample:
    """The Sample that stands for one episode (its last branch; `run_episode_samples` gives
    every branch, which is what training needs when the chat template branches).

    Raises:
        EngineError: an engine request failed.
    """
    samples = await run_episode_samples(env, ctx, chat, index=index, metadata=metadata,
                                        config=config)  # fmt: skip
    return samples[0]


def multiturn_generate(
    make_env: EnvFactory,
    *,
    tokenizer: Any = None,
    config: MultiTurnConfig = MultiTurnConfig(),
) -> GenerateFn:
    """A GenerateFn running `n` concurrent episodes of `make_env(prompt)` per prompt.

    Pass it as `generate_fn=` to `collect_groups` / the rollout manager, with
    `reward_fn=env_reward` to keep the envs' rewards.

    Args:
        make_env: a fresh env per sample.
        tokenizer: the policy's tokenizer (default: the one in the GenerateContext).
        config: turn and token limits, stop condition.

    Raises (from the returned function):
        ConfigError: no tokenizer was given either way.
    """
    chat_for = chat_turns_per_tokenizer("multiturn_generate", config.template_kwargs)

    async def generate(prompt: PromptItem, n: int, ctx: GenerateContext) -> list[Sample]:
        chat = chat_for(tokenizer if tokenizer is not None else ctx.tokenizer)
        out: list[list[Sample]] = [[] for _ in range(n)]

        async def one(i: int) -> None:
            samples = await run_episode_samples(make_env(prompt), ctx, chat, index=i,
                                                metadata=prompt.metadata, config=config)  # fmt: skip
            out[i] = samples
            for sample in samples:
                ctx.report(sample)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        return [s for samples in out for s in samples]

    return generate
