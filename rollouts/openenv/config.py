"""The `env.openenv` section of an RL config: where the OpenEnv server is and how episodes use it."""

from __future__ import annotations

from pydantic import Field, model_validator

from rollouts.config import Strict


class OpenEnvConfig(Strict):
    """An OpenEnv MCP tool environment (docs/environments.md). Give `url` (a server you run) or
    `app` (the recipe starts `uvicorn <app>` on 127.0.0.1 and stops it at the end)."""

    url: str | None = Field(None, description="http(s)://host:port of a running env server")
    app: str | None = Field(
        None,
        description="module:attribute of an OpenEnv FastAPI app (e.g. from create_app) the "
        "recipe serves on 127.0.0.1 for the run; imported from the working directory",
    )
    startup_timeout_s: float = Field(120.0, gt=0, description="`app`: wait this long for /health")
    env_name: str | None = Field(
        None, description="the name given to create_app(env_name=...): the task routes' prefix"
    )
    train_split: str | None = Field(
        None,
        description="prompts from the env's task provider: this split's tasks (else the "
        "data: section's prompt files; their metadata.reset is passed to reset())",
    )
    eval_split: str | None = Field(None, description="held-out prompts from this split")
    prompt_key: str = Field("prompt", description="the task field that is the user message")
    max_tasks: int | None = Field(None, ge=1, description="use the first N tasks of a split")
    answer_tool: str | None = Field(
        None,
        description="a turn without tool calls is sent as a call of this tool (e.g. "
        "submit_answer) with the turn's text as `answer_argument`; null: such a turn ends the "
        "episode with the rewards given so far",
    )
    answer_argument: str = "answer"
    max_calls_per_turn: int = Field(4, ge=1)
    max_output_chars: int = Field(2000, ge=1, description="a tool result is cut to this length")
    step_timeout_s: float = Field(60.0, gt=0, description="one reset or tool call's deadline")
    max_sessions: int = Field(
        64, ge=1,
        description="episodes holding a session (a WebSocket) at once; keep it at or under the "
        "server's max_concurrent_envs",
    )  # fmt: skip

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvConfig:
        if (self.url is None) == (self.app is None):
            raise ValueError(
                "env.openenv: give url (a running env server) or app (module:attribute the "
                "recipe serves on 127.0.0.1), exactly one"
            )
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"env.openenv.url must start with http:// or https://, got {self.url!r}"
            )
        if self.app is not None and ":" not in self.app:
            raise ValueError(f"env.openenv.app must be module:attribute, got {self.app!r}")
        if (self.train_split or self.eval_split) and not self.env_name:
            raise ValueError(
                "env.openenv.train_split/eval_split read the env's task routes "
                "(/{env_name}/task_range): set env.openenv.env_name to the name given to create_app"
            )
        return self
