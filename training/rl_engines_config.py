"""The `engines:` section of an RL run's config (training/rl_config.py re-exports it): where the
engines are, how they are launched, paused and given weights, and the bounds of each wait."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollouts.config import Strict


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
    local_prefix_cache: bool = Field(
        True,
        description="launched local engines keep a radix prefix cache (false: "
        "--disable-radix-cache)",
    )
    exact_logprobs: bool = Field(
        False,
        description="true on-policy: launched local engines return each sampled token's "
        "logprob as the trainer computes it (--exact-logprobs: the finished sequence rescored "
        "alone, one full forward), and the trainer scores each sample alone too (one sample per "
        "micro-batch, train.share_prompts off), so logprob_diff_max_abs is 0.0 "
        "(docs/engines.md, 'Exact logprobs')",
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
    colocate: bool = Field(
        False,
        description="generation and training share the node's memory: once a step's batch is "
        "generated every engine releases its weights' and KV memory (/release_memory_occupation"
        "; SGLang: --enable-memory-saver) and takes it back before the step's weights are pushed;"
        " needs rollout.mode=sync; disk pushes go through /dev/shm (docs/engines.md)",
    )
    weight_group_timeout_s: float = Field(
        120.0,
        gt=0,
        description="distributed: deadline of the group's rendezvous (and of each engine's HTTP "
        "call of an update, plus 30 s)",
    )
    weight_broadcast_timeout_s: float = Field(
        30.0,
        gt=0,
        description="distributed: deadline of each bucket's broadcast; an engine that stalls "
        "mid-update costs about this + 10 s, then the push goes through disk. It must exceed "
        "the time one bucket takes to reach every engine (weight_bucket_mb x engines over the "
        "link's bandwidth, gloo)",
    )
