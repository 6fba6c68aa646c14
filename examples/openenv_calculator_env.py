"""An OpenEnv MCP tool environment for the multiplication task, written with OpenEnv's own
server classes (`MCPEnvironment`, `create_app`): what `configs/openenv_tiny.yaml` trains on.

    python -m uvicorn examples.openenv_calculator_env:app --host 127.0.0.1 --port 8000

Each episode is one task, `What is A * B?` (3-4 digit numbers, as the project's multiply task),
chosen by `reset(split=..., index=...)`. Tools: `calculator(expression)` evaluates arithmetic;
`submit_answer(answer)` ends the episode with reward 1.0 when the answer's last integer is the
product (else 0.0). Its task provider serves the splits `train` (4000 tasks) and `test` (200).
With OPENENV_CALCULATOR_LOG=FILE set, every tool call the server receives is appended to FILE
as one JSON line (episode id, task, tool, arguments, reward, done): what the tests read.

Needs `pip install rollouts[openenv]` (openenv 0.10.0).
"""

from __future__ import annotations

import json
import os
import random
import re
import uuid
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State

from rollouts.tools.calculator import evaluate_arithmetic, format_number

SPLITS = {"train": 4000, "test": 200}


def make_task(split: str, index: int) -> dict[str, Any]:
    """Task `index` of `split`: the same for every server and client (seeded by both)."""
    if split not in SPLITS or not 0 <= index < SPLITS[split]:
        raise IndexError(f"no task {index} in split {split!r}")
    rng = random.Random(f"{split}:{index}")
    a, b = rng.randint(100, 9999), rng.randint(100, 9999)
    return {"id": f"{split}-{index}", "prompt": f"What is {a} * {b}?", "answer": str(a * b),
            "split": split, "index": index}  # fmt: skip


def is_right(answer: str, truth: str) -> bool:
    numbers = re.findall(r"-?\d+", str(answer).replace(",", ""))
    return bool(numbers) and numbers[-1] == truth


class CalculatorEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("calculator")

        @mcp.tool
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses."""
            return format_number(evaluate_arithmetic(expression))

        @mcp.tool
        def submit_answer(answer: str) -> str:
            """Submit the final answer; this ends the episode."""
            return "submitted"

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self._task = make_task("train", 0)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              split: str = "train", index: int = 0, **kwargs: Any) -> Observation:  # fmt: skip
        self._task = make_task(split, int(index))
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return Observation(done=False, reward=0.0, metadata={"prompt": self._task["prompt"]})

    def _graded(self, action: Any, obs: Observation) -> Observation:
        """The observation of a tool call; `submit_answer` ends the episode with its reward."""
        self._state.step_count += 1
        if not isinstance(action, CallToolAction):
            return obs
        if action.tool_name == "submit_answer":
            reward = float(is_right(action.arguments.get("answer", ""), self._task["answer"]))
            obs = CallToolObservation(tool_name=action.tool_name, result=obs.result,
                                      error=obs.error, done=True, reward=reward)  # fmt: skip
        log_call(self._state.episode_id, self._task["id"], action, obs)
        return obs

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._graded(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Any, timeout_s: float | None = None,
                         **kwargs: Any) -> Observation:  # fmt: skip
        # the WebSocket path calls step_async, not step: grade here too
        return self._graded(action, await super().step_async(action, timeout_s=timeout_s,
                                                             **kwargs))  # fmt: skip

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0,
                           metadata={"error": "use list_tools or call_tool actions"})  # fmt: skip

    @property
    def state(self) -> State:
        return self._state

    # the task provider (OpenEnv's TaskProvider protocol)
    def list_splits(self) -> list[str]:
        return list(SPLITS)

    def num_tasks(self, split: str) -> int:
        return SPLITS[split]

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        return make_task(split, index)

    def get_task_range(self, split: str, start: int | None = None,
                       stop: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
        return [make_task(split, i) for i in range(SPLITS[split])[start:stop]]

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return self.get_task_range(split)


def log_call(episode_id: str, task_id: str, action: CallToolAction, obs: Observation) -> None:
    path = os.environ.get("OPENENV_CALCULATOR_LOG")
    if not path:
        return
    row = {"episode_id": episode_id, "task": task_id, "tool": action.tool_name,
           "arguments": action.arguments, "reward": obs.reward, "done": obs.done,
           "error": obs.error.message if getattr(obs, "error", None) else None}  # fmt: skip
    with open(path, "a", encoding="utf-8") as f:  # one short line per write: appends stay whole
        f.write(json.dumps(row) + "\n")


app = create_app(CalculatorEnvironment, CallToolAction, CallToolObservation,
                 env_name="calculator", max_concurrent_envs=512)  # fmt: skip
