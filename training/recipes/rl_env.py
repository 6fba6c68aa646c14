"""The `env:` section of an RL config → the rollout's GenerateFn, reward and evaluation setup.

`single_turn` is the default one-assistant-turn rollout. `tools` runs multi-turn episodes
(`rollouts.multiturn`) in a `ToolEnv` with the configured tools; the env grades the final
answer, so the reward is `env_reward` unless the config names another. `agent` runs an agent
written for the OpenAI API (`agent.command`, `agent.fn`, or one the program passes) behind
the agent proxy (`rollouts.agent`); the agent returns the reward, kept by `env_reward` unless
the config names another reward. `openenv` runs multi-turn episodes in an OpenEnv MCP tool
environment at `env.openenv.url` (`rollouts.openenv`; the recipe serves `env.openenv.app`
first); the env gives the rewards, kept by `env_reward` unless the config names another.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plumbing.errors import ConfigError
from rollouts.agent import (
    AgentConfig,
    SessionLimits,
    agent_generate,
    python_harness,
    subprocess_harness,
)
from rollouts.agent.harness import Harness, OpenAIAgent
from rollouts.config import RolloutConfig
from rollouts.envs import env_reward, tool_env_factory
from rollouts.evaluation import evaluate_greedy
from rollouts.generate_fn import GenerateFn, single_turn_generate
from rollouts.multiturn import MultiTurnConfig, multiturn_generate
from rollouts.openenv.episode import openenv_generate, task_records
from rollouts.openenv.wire import fetch_tasks
from rollouts.prompts import PromptItem
from rollouts.rewards import RewardFn
from rollouts.tools import (
    Tool,
    ToolParser,
    calculator_tool,
    parse_hermes_tool_calls,
    parse_xml_tool_calls,
)
from rollouts.tools import python_tool as make_python_tool
from training.rl_config import AgentSection, EnvSection, RewardConfig, RLRunConfig

_PARSERS = {"hermes": parse_hermes_tool_calls, "xml": parse_xml_tool_calls}


def build_tools(section: EnvSection) -> list[Tool]:
    makers: dict[str, Callable[[], Tool]] = {"calculator": calculator_tool,
                                             "python": make_python_tool}  # fmt: skip
    return [replace(makers[name](), timeout_s=section.tool_timeout_s) for name in section.tools]


@dataclass(frozen=True)
class EpisodeSetup:
    generate_fn: GenerateFn
    reward_fn: RewardFn

    async def evaluate(self, engine: Any, prompts: Sequence[PromptItem], reward_fn: RewardFn, *,
                       rollout: RolloutConfig, max_new_tokens: int,
                       tokenizer: Any) -> dict[str, float]:  # fmt: skip
        """Greedy held-out episodes of this env, scored as training scores: the reward under
        `rollout.reward_timeout_s` (not evaluate_greedy's own 30 s default)."""
        return await evaluate_greedy(engine, prompts, reward_fn, max_new_tokens=max_new_tokens,
                                     generate_fn=self.generate_fn, tokenizer=tokenizer,
                                     timeout_s=rollout.reward_timeout_s,
                                     stall_warning_s=rollout.stall_warning_s)  # fmt: skip


def build_harness(section: AgentSection, resolve: Callable[[str], Any],
                  agent: OpenAIAgent | None) -> Harness:  # fmt: skip
    """The agent program: the one passed in, else `agent.fn`, else `agent.command`.

    Raises:
        ConfigError: `env.kind` is agent and no agent is given.
    """
    if agent is not None:
        return python_harness(agent)
    if section.fn is not None:
        return python_harness(resolve(section.fn))
    if section.command is not None:
        return subprocess_harness(section.command)
    raise ConfigError("env.kind is agent but no agent is given: set agent.command or agent.fn "
                      "(or pass RLExtensions(agent=...))")  # fmt: skip


def build_episode_setup(section: EnvSection, reward: RewardConfig, *,
                        resolve: Callable[[str], Any],
                        template_kwargs: Mapping[str, Any] | None = None,
                        agent_section: AgentSection | None = None,
                        agent: OpenAIAgent | None = None,
                        parser: ToolParser | None = None) -> EpisodeSetup:  # fmt: skip
    """GenerateFn and reward for the configured env (`resolve` imports `module:function`;
    `template_kwargs`: extra chat-template variables of multi-turn episodes; `agent_section`
    and `agent`: the agent of `env.kind: agent`; `parser`: replaces `env.parser`).

    Raises:
        ConfigError: env.kind openenv whose server has no URL yet (serve `env.openenv.app`
            first, as `run_rl_recipe` does).
    """
    if section.kind == "single_turn":
        return EpisodeSetup(single_turn_generate, resolve(reward.fn))
    explicit = "fn" in reward.model_fields_set
    parser = parser or _PARSERS[section.parser]
    if section.kind == "agent":
        agents = agent_section or AgentSection()
        config = AgentConfig(timeout_s=agents.timeout_s, parser=parser,
                             limits=SessionLimits(agents.max_calls, section.max_response_tokens),
                             template_kwargs=dict(template_kwargs or {}))  # fmt: skip
        generate = agent_generate(build_harness(agents, resolve, agent), config=config)
        return EpisodeSetup(generate, resolve(reward.fn) if explicit else env_reward)
    config = MultiTurnConfig(max_turns=section.max_turns,
                             max_response_tokens=section.max_response_tokens,
                             template_kwargs=dict(template_kwargs or {}))  # fmt: skip
    if section.kind == "openenv":
        server = section.openenv
        if server is None or server.url is None:
            raise ConfigError("env.kind openenv needs the env server's URL: set env.openenv.url, "
                              "or serve env.openenv.app first (run_rl_recipe does)")  # fmt: skip
        generate = openenv_generate(server, server.url, parser=parser, multiturn=config,
                                    system_prompt=section.system_prompt,
                                    show_specs=section.show_specs)  # fmt: skip
        return EpisodeSetup(generate, resolve(reward.fn) if explicit else env_reward)
    make_env = tool_env_factory(
        build_tools(section), resolve(section.grader), parser=parser,
        system_prompt=section.system_prompt, show_specs=section.show_specs,
    )  # fmt: skip
    return EpisodeSetup(multiturn_generate(make_env, config=config),
                        resolve(reward.fn) if explicit else env_reward)  # fmt: skip


def with_env_url(config: RLRunConfig, url: str) -> RLRunConfig:
    """`config` with its OpenEnv server at `url` (the app the recipe serves for the run)."""
    server = config.env.openenv
    assert server is not None
    served = server.model_copy(update={"url": url, "app": None})
    return config.model_copy(update={"env": config.env.model_copy(update={"openenv": served})})


def openenv_task_files(config: RLRunConfig) -> tuple[str, str | None] | None:
    """(train, held-out) prompt files made from the env's task provider (`env.openenv.
    train_split`, `eval_split`; else `data.eval_path`), written under
    `output_dir/openenv_tasks/`; None when the prompts do not come from the env.

    Raises:
        OpenEnvError: the task routes failed or a task has no prompt (named).
    """
    server = config.env.openenv
    if server is None or server.train_split is None:
        return None
    url, name = server.url, server.env_name
    assert url is not None and name is not None  # the app is served and the config validated
    out_dir = Path(config.output_dir) / "openenv_tasks"
    out_dir.mkdir(parents=True, exist_ok=True)

    def write(split: str) -> str:
        tasks = fetch_tasks(url, name, split, limit=server.max_tasks)
        path = out_dir / f"{split}.jsonl"
        lines = [json.dumps(r) for r in task_records(tasks, split, server.prompt_key)]
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return str(path)

    train = write(server.train_split)
    return train, (write(server.eval_split) if server.eval_split else config.data.eval_path)
