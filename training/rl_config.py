"""Configuration of RL runs (`configs/rl_*.yaml`): frozen pydantic models, unknown keys rejected."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rollouts.config import RolloutConfig, Strict
from training.config import (
    BackendConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    TaskDataSource,
)
from training.teacher_config import TeacherSection
from training.trl_names import RL_TABLES


class RLDataConfig(TaskDataSource):
    max_prompt_len: int = Field(1024, ge=1)


class EnginesConfig(Strict):
    kind: Literal["sglang", "vllm"] = Field(
        "sglang",
        description="the protocol of the servers at `urls`: SGLang (and the local engine), or "
        "vLLM started with VLLM_SERVER_DEV_MODE=1 (engines/vllm.py; never launched here)",
    )
    urls: list[str] = Field([], description="live SGLang servers; empty: launch local engines")
    router_url: str | None = Field(
        None, description="sgl-model-gateway for generation; `urls` (or its GET /workers) = workers"
    )
    control_plane: Literal["auto", "direct", "gateway"] = Field(
        "auto",
        description=(
            "with router_url, where weight syncs go: each worker directly, or smg's /v1/rl "
            "control plane (smg >= 1.11 run with --enable-rl); auto = direct when every worker "
            "answers GET /model_info within 2 s, else the gateway"
        ),
    )
    api_key: str | None = None
    admin_api_key: str | None = Field(None, description="SGLang --admin-api-key (control routes)")
    n_local: int = Field(1, ge=1)
    local_threads: int | None = Field(1, ge=1, description="torch threads per local engine")
    local_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="where launched local engines run (`rollouts serve --device`)"
    )
    local_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the dtype launched local engines hold the weights in"
    )
    max_running_requests: int = Field(64, ge=1)
    startup_timeout_s: float = Field(300.0, gt=0)
    generate_timeout_s: float = Field(600.0, gt=0)
    unavailable_timeout_s: float = Field(
        60.0,
        gt=0,
        description="how long a request waits for an engine to come back after a transient "
        "failure (reset, 5xx, truncated body, timeout) before its group fails, and a weight "
        "push whose engines are all down waits for one before the run fails",
    )
    stall_floor_s: float | None = Field(
        60.0,
        gt=0,
        description="a /generate unanswered after stall_floor_s + stall_s_per_token × "
        "max_new_tokens is aborted and re-sent to another engine (None: only generate_timeout_s). "
        "The time includes queueing in the engine: the defaults allow 5 tokens/s per sequence",
    )
    stall_s_per_token: float | None = Field(0.2, gt=0, description="see stall_floor_s")
    weight_update_floor_s: float = Field(
        30.0,
        gt=0,
        description="a weight load (/update_weights_from_disk, /load_lora_adapter) unanswered "
        "after weight_update_floor_s + weight_update_s_per_gb × the weights' GB is given up: "
        "that engine counts as down (one WARNING), is no longer held paused, and is given the "
        "weights when it loads them in time. Raise both where loads are slow (network disks)",
    )
    weight_update_s_per_gb: float = Field(10.0, ge=0, description="see weight_update_floor_s")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "abort",
        description=(
            "how a weight sync pauses the engines: abort in-flight requests (SGLang's RL "
            "recipe); retract them (recomputed on the new weights after the sync's cache flush); "
            "in_place (they finish on their old KV, spans in weight_versions; later requests "
            "use a new prefix-cache namespace, extra_key, so none reuses old-weight KV)"
        ),
    )
    max_relaunches: int = Field(3, ge=0, description="local engines relaunched when they die")
    weight_transport: Literal["disk", "distributed"] = Field(
        "disk",
        description=(
            "how full weights reach the engines at each push: disk (HF export under the run's "
            "weights/, /update_weights_from_disk; trainer and engines share a filesystem) or "
            "distributed (SGLang's refit: a process group between trainer rank 0 and every "
            "engine, the weights broadcast in buckets, nothing written unless an engine is out "
            "of the group; docs/engines.md). LoRA adapters always go through disk"
        ),
    )
    weight_bucket_mb: float = Field(
        512.0, gt=0, description="distributed: MiB per broadcast (one gathered bucket at a time)"
    )
    weight_master_address: str = Field(
        "127.0.0.1",
        description="distributed: the trainer's address as the engines reach it (the group's "
        "TCP store listens there on a free port)",
    )
    weight_group_backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="distributed: gloo (CPU tensors) or nccl (the trainer sends from CUDA)"
    )
    weight_group_timeout_s: float = Field(
        120.0,
        gt=0,
        description="distributed: deadline of the group's rendezvous and each broadcast",
    )


class RewardConfig(Strict):
    fn: str = Field(
        "rollouts.tasks.arithmetic:correctness_reward",
        description="module:function returning a reward callable's value for a sample",
    )


class EnvSection(Strict):
    """How an episode runs: one assistant turn, multi-turn with tools (rollouts.multiturn), or
    an agent written for the OpenAI API behind the agent proxy (`agent`; see AgentSection)."""

    kind: Literal["single_turn", "tools", "agent"] = "single_turn"
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


class AgentSection(Strict):
    """The agent of `env.kind: agent` (rollouts.agent; docs/agents.md). `env.parser` reads its
    tool calls, `env.max_response_tokens` bounds each session; a program may pass the agent
    itself instead (`RLExtensions(agent=...)`)."""

    command: list[str] | None = Field(
        None, description="argv of a subprocess agent: OPENAI_BASE_URL/OPENAI_API_KEY set, "
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
