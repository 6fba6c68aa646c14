"""Configuration of RL runs (`configs/rl_*.yaml`): frozen pydantic models, unknown keys rejected."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rollouts.config import RolloutConfig, Strict
from rollouts.openenv.config import OpenEnvConfig
from training.config import (
    BackendConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    TaskDataSource,
)
from training.exact_logprobs_checks import exact_logprobs_conflicts
from training.rl_engines_config import EnginesConfig as EnginesConfig
from training.teacher_config import TeacherSection
from training.trl_names import RL_TABLES


class RLDataConfig(TaskDataSource):
    max_prompt_len: int = Field(1024, ge=1)


class RewardConfig(Strict):
    fn: str = Field(
        "rollouts.tasks.arithmetic:correctness_reward",
        description="module:function returning a reward callable's value for a sample",
    )


class EnvSection(Strict):
    """How an episode runs: one assistant turn, multi-turn with tools (rollouts.multiturn), an
    agent written for the OpenAI API behind the agent proxy (`agent`; see AgentSection), or
    multi-turn in an OpenEnv MCP tool environment (`openenv`; see OpenEnvConfig)."""

    kind: Literal["single_turn", "tools", "agent", "openenv"] = "single_turn"
    tools: list[Literal["calculator", "python"]] = ["calculator"]
    parser: Literal["hermes", "xml"] = "hermes"
    grader: str = Field(
        "rollouts.envs:arithmetic_grader",
        description="module:function (final model text, metadata) -> reward of the answer",
    )
    system_prompt: str | None = None
    show_specs: bool = Field(True, description="render the tools' JSON schemas into the prompt")
    max_turns: int = Field(4, ge=1)
    max_response_tokens: int | None = Field(128, ge=1, description="all turns together")
    tool_timeout_s: float = Field(10.0, gt=0)
    openenv: OpenEnvConfig | None = Field(None, description="env.kind openenv: the env server")

    @model_validator(mode="after")
    def _openenv_has_its_section(self) -> EnvSection:
        if (self.kind == "openenv") != (self.openenv is not None):
            raise ValueError("env.openenv (url or app of the env server) goes with env.kind "
                             f"openenv and only with it; env.kind is {self.kind}")  # fmt: skip
        # the env server lists and runs the tools and grades the answers
        foreign = sorted({"tools", "grader", "tool_timeout_s"} & self.model_fields_set)
        if self.kind == "openenv" and foreign:
            raise ValueError(f"env.{', env.'.join(foreign)} do not apply to env.kind openenv: "
                             "the env server lists the tools and gives the rewards")  # fmt: skip
        return self


class AgentSection(Strict):
    """The agent of `env.kind: agent` (rollouts.agent; docs/agents.md). `env.parser` reads its
    tool calls, `env.max_response_tokens` bounds each session; a program may pass the agent
    itself instead (`RLExtensions(agent=...)`)."""

    command: list[str] | None = Field(
        None, description="argv of a subprocess agent: OPENAI_BASE_URL/OPENAI_API_KEY (and "
        "ANTHROPIC_BASE_URL/ANTHROPIC_API_KEY) set, "
        "task JSON on stdin, reward as the last line of stdout",
    )  # fmt: skip
    fn: str | None = Field(
        None, description="module:function, async (openai.AsyncOpenAI, task) -> reward | None"
    )
    timeout_s: float = Field(120.0, gt=0, description="one session's wall-clock budget")
    max_calls: int = Field(16, ge=1, description="chat-completions calls per session")

    @model_validator(mode="after")
    def _one_program(self) -> AgentSection:
        if self.command is not None and self.fn is not None:
            raise ValueError("agent: give command or fn, not both")
        if self.command is not None and not self.command:
            raise ValueError("agent.command is empty: give the program's argv")
        return self


Preset = Literal[
    "grpo",
    "dr_grpo",
    "dapo",
    "gspo",
    "cispo",
    "rloo",
    "reinforce_pp",
    "online_dpo",
    "ppo",
    "distill",
]
Overrides = dict[str, float | int | str | bool | None]


class AlgorithmSwitch(Strict):
    """From step `at_step` on, train with `preset` and its `overrides`."""

    at_step: int = Field(ge=2)
    preset: Preset
    overrides: Overrides = {}


class AlgorithmSection(Strict):
    """The algorithm preset and overrides, and the switches to other presets mid-run.

    ```yaml
    algorithm:
      preset: grpo
      overrides: {kl_coef: 0.2}
      switches:
        - {at_step: 30, preset: grpo, overrides: {kl_coef: 0.05}}
        - {at_step: 60, preset: dapo}
    ```
    `then` + `switch_at_step` is the one-switch shorthand (`then` takes no overrides).
    """

    preset: Preset = "grpo"
    overrides: Overrides = {}
    switches: list[AlgorithmSwitch] = []
    then: Preset | None = None
    switch_at_step: int | None = Field(None, ge=2)

    @model_validator(mode="after")
    def _switches_are_ordered(self) -> AlgorithmSection:
        if (self.then is None) != (self.switch_at_step is None):
            raise ValueError("algorithm.then and algorithm.switch_at_step go together")
        if self.then is not None and self.switches:
            raise ValueError("give algorithm.switches or algorithm.then, not both")
        steps = [s.at_step for s in self.switches]
        if steps != sorted(set(steps)):
            raise ValueError(f"algorithm.switches: at_step must increase, got {steps}")
        return self

    def all_switches(self) -> list[AlgorithmSwitch]:
        """`switches`, or the `then` shorthand as one switch."""
        if self.then is not None and self.switch_at_step is not None:
            return [AlgorithmSwitch(at_step=self.switch_at_step, preset=self.then)]
        return list(self.switches)


class PrometheusConfig(Strict):
    """`train.prometheus`: serve GET /metrics in the Prometheus text format (docs/prometheus.md)."""

    host: str = Field("127.0.0.1", description="address to listen on (loopback by default)")
    port: int = Field(9464, ge=0, le=65535, description="TCP port (0: any free one, logged)")


class RLLoopConfig(Strict):
    max_steps: int = Field(50, ge=1)
    sync_every: int = Field(1, ge=1)
    log_every: int = Field(1, ge=1)
    sample_every: int = Field(
        10, ge=0,
        description="log one sample's prompt, response and reward at the run's first step and "
        "every this many steps (0: never), so a person sees what the model writes",
    )  # fmt: skip
    eval_every: int = Field(10, ge=1)
    eval_samples: int = Field(300, ge=0, description="held-out prompts for greedy accuracy")
    eval_max_new_tokens: int = Field(16, ge=1)
    checkpoint_every: int = Field(25, ge=1)
    keep_last: int = Field(2, ge=1)
    resume: Literal["auto", "never"] = "never"
    dump_rollouts: bool = False
    prometheus: PrometheusConfig | None = Field(
        None, description="a Prometheus /metrics endpoint on the trainer (off by default)"
    )
    share_prompts: bool = Field(True, description="score a group's responses on one prompt copy")
    mini_batches: int = Field(
        1, ge=1, description="optimizer steps per pass over a rollout batch (whole groups each)"
    )
    epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    no_signal_steps: int = Field(
        10, ge=1,
        description="steps in a row whose groups all had equal rewards (no learning signal) "
        "before one WARNING says why (training/rl/signal.py)",
    )  # fmt: skip
    ema_metrics: list[str] = Field(
        ["reward_mean"],
        description="metrics also logged as an exponential moving average, <name>_ema "
        "(training/loops/ema.py); checkpointed with the step's metrics, so resume continues it",
    )
    ema_decay: float = Field(0.9, ge=0, lt=1, description="weight of the past in each *_ema")
    max_empty_batches: int = Field(
        3, ge=1,
        description="rollout batches in a row with no accepted group (every sample failed or "
        "every group was filtered) before the run ends; each is skipped, logged and counted",
    )  # fmt: skip


class RLRunConfig(Strict):
    trl_tables: ClassVar[tuple[str, ...]] = RL_TABLES  # TRL names an unknown key is matched to
    output_dir: str = "runs/rl"
    sft_config: str | None = Field(
        "configs/sft_tiny.yaml",
        description="with model.path null: start from this SFT recipe's checkpoint (run if missing)",
    )
    model: ModelConfig = ModelConfig()
    data: RLDataConfig = RLDataConfig()
    engines: EnginesConfig = EnginesConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmSection = AlgorithmSection()
    reward: RewardConfig = RewardConfig()
    env: EnvSection = EnvSection()
    agent: AgentSection = AgentSection()
    optim: OptimConfig = OptimConfig(lr=1e-5, schedule="constant", grad_clip=1.0)
    critic_optim: OptimConfig | None = Field(
        None,
        description="PPO's critic; None: the policy's optim with 10x its lr (a value head "
        "starts from scratch and must keep up with the policy, as verl's defaults assume)",
    )
    backend: BackendConfig = BackendConfig()
    train: RLLoopConfig = RLLoopConfig()
    logging: LoggingConfig = LoggingConfig()
    teacher: TeacherSection | None = Field(None, description="algorithm.preset distill's teacher")

    @model_validator(mode="after")
    def _distill_has_its_teacher(self) -> RLRunConfig:
        presets = [self.algorithm.preset, *(s.preset for s in self.algorithm.all_switches())]
        distills = "distill" in presets
        if distills and self.teacher is None:
            raise ValueError(
                "algorithm.preset distill needs a teacher: set teacher.model=DIR (a local "
                "engine is launched on it) or teacher.engine_url=URL (a running engine)"
            )
        if self.teacher is not None and not distills:
            raise ValueError("teacher is set but no algorithm uses it: set algorithm.preset="
                             "distill (or a switch to it), or remove the teacher section")  # fmt: skip
        filtered = [o for o in (self.algorithm.overrides,
                                *(s.overrides for s in self.algorithm.switches))
                    if o.get("distill_filter_nats") is not None]  # fmt: skip
        if filtered and self.rollout.filter_groups != "auto":
            raise ValueError(
                f"algorithm.overrides.distill_filter_nats is applied by rollout.filter_groups: "
                f"auto, and this config sets rollout.filter_groups: "
                f"{self.rollout.filter_groups} (it would do nothing): set auto, or drop it"
            )
        if distills and self.rollout.sampling.temperature != 1.0:
            raise ValueError(
                f"algorithm distill with rollout.sampling.temperature="
                f"{self.rollout.sampling.temperature}: the teacher's logprobs are of its "
                "untempered distribution (SGLang's input logprobs are not temperature-scaled), "
                "so the student must sample at temperature 1.0 for the KL to compare the same "
                "distributions"
            )
        return self

    @model_validator(mode="after")
    def _distributed_weights_are_full_weights(self) -> RLRunConfig:
        if self.engines.weight_transport != "distributed":
            return self
        if self.model.lora is not None:
            raise ValueError(
                "engines.weight_transport=distributed with model.lora: LoRA adapters are pushed "
                "through disk (/load_lora_adapter, a few MB); set engines.weight_transport=disk "
                "(the trainer and the engines must share a filesystem)"
            )
        if self.engines.router_url is not None and self.engines.control_plane != "direct":
            raise ValueError(
                "engines.weight_transport=distributed with a router needs "
                "engines.control_plane=direct: each worker joins the trainer's group itself"
            )
        ec, trainer = self.engines, self.backend.device
        if (ec.weight_group_backend == "nccl" and not ec.urls and ec.router_url is None
                and ec.local_device == "cuda" and trainer in ("cuda", "cuda:0")):  # fmt: skip
            raise ValueError(  # NCCL's "Duplicate GPU detected", at the first push
                "engines.weight_group_backend=nccl with local engines launched on cuda: they "
                f"and the trainer's rank 0 ({trainer}) are on GPU 0, and NCCL refuses two ranks "
                "of one group on one GPU; set engines.weight_group_backend=gloo"
            )
        return self

    @model_validator(mode="after")
    def _one_prompt_source(self) -> RLRunConfig:
        server = self.env.openenv
        if server is not None and server.train_split and self.data.train_path is not None:
            raise ValueError("give data.train_path or env.openenv.train_split (the env's tasks "
                             "as prompts), not both")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _exact_logprobs_on_both_sides(self) -> RLRunConfig:
        if not self.engines.exact_logprobs:
            return self
        refuse = exact_logprobs_conflicts(self)
        if refuse:
            raise ValueError(f"engines.exact_logprobs=true {refuse}")
        # the trainer scores each sample alone, as the engine does: no shared prompt rows
        # (a copy: the default RLLoopConfig instance is shared by every config)
        object.__setattr__(self, "train", self.train.model_copy(update={"share_prompts": False}))
        return self

    @model_validator(mode="after")
    def _mini_batches_fit_the_batch(self) -> RLRunConfig:
        if self.train.mini_batches > self.rollout.batch_size:
            raise ValueError(
                f"train.mini_batches ({self.train.mini_batches}) exceeds rollout.batch_size "
                f"({self.rollout.batch_size}): a mini-batch holds at least one whole group"
            )
        return self

    @model_validator(mode="after")
    def _vllm_does_what_the_run_needs(self) -> RLRunConfig:
        # what VLLMEngine cannot do (its module docstring): refused here, before anything starts
        ec = self.engines
        if ec.kind != "vllm":
            return self
        refused = [
            (not ec.urls, "engines.urls is empty: vLLM servers are not launched by the recipe "
             "(start one: VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server "
             "--model DIR) and give its URL"),
            (ec.router_url is not None, "engines.router_url: the gateway speaks SGLang's protocol"),
            (ec.pause_mode == "retract", "engines.pause_mode=retract: vLLM pauses with abort, "
             "wait or keep (use abort, or in_place for keep)"),
            (self.model.lora is not None, "model.lora: LoRA adapters are not hot-loaded into "
             "vLLM by this project"),
            (ec.weight_transport == "distributed", "engines.weight_transport=distributed: the "
             "broadcast speaks SGLang's refit routes (vLLM loads weights from disk here)"),
        ]  # fmt: skip
        reasons = [why for bad, why in refused if bad]
        if reasons:
            raise ValueError("engines.kind=vllm cannot run with " + "; ".join(reasons))
        return self

    @model_validator(mode="after")
    def _colocated_engines_rest_while_training(self) -> RLRunConfig:
        ec = self.engines
        refused = [
            (self.rollout.mode != "sync", f"rollout.mode={self.rollout.mode}: the engines "
             "generate while the trainer trains; use rollout.mode=sync"),
            (self.model.lora is not None, "model.lora: a LoRA push loads the adapter, not the "
             "base weights a release frees"),
            (ec.kind == "vllm", "engines.kind=vllm: its sleep mode is not driven here"),
            (ec.router_url is not None, "engines.router_url: the gateway has no memory routes; "
             "list the workers in engines.urls"),
        ]  # fmt: skip
        reasons = [why for bad, why in refused if bad]
        if ec.colocate and reasons:
            raise ValueError("engines.colocate=true cannot run with " + "; ".join(reasons))
        return self

    @model_validator(mode="after")
    def _sync_mode_is_on_policy(self) -> RLRunConfig:
        # Sync mode trains on its samples as on-policy; with sync_every > 1 they come from
        # weights up to sync_every - 1 versions old (measured: -13.2 held-out points in 30 steps).
        if self.rollout.mode == "sync" and self.train.sync_every > 1:
            raise ValueError(
                f"rollout.mode=sync with train.sync_every={self.train.sync_every} would train "
                "stale samples as on-policy; use train.sync_every=1, or rollout.mode=overlap / "
                "async (engine logprobs as the behaviour policy, staleness counted)"
            )
        return self

    @model_validator(mode="after")
    def _workers_run_single_turn_episodes(self) -> RLRunConfig:
        ec = self.engines
        refused = [
            (self.env.kind != "single_turn", f"env.kind={self.env.kind}: a worker runs single-"
             "turn episodes only for now; use env.kind=single_turn"),
            (ec.router_url is not None, "engines.router_url: each worker drives a slice of the "
             "engines, listed in engines.urls (or launched: engines.n_local)"),
            (ec.kind == "vllm", "engines.kind=vllm: workers speak SGLang's protocol"),
            (ec.colocate, "engines.colocate=true: not tried with workers yet"),
            (ec.pause_mode == "in_place", "engines.pause_mode=in_place: a worker's requests "
             "keep their prefix-cache namespace across the trainer's pauses, so they would "
             "reuse KV of the old weights; use engines.pause_mode=abort or retract"),
        ]  # fmt: skip
        reasons = [why for bad, why in refused if bad]
        if self.rollout.workers and reasons:
            raise ValueError(f"rollout.workers={self.rollout.workers} cannot run with "
                             + "; ".join(reasons))  # fmt: skip
        return self
