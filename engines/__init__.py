"""Talking to inference servers: the SGLang HTTP protocol, a pool, a launcher, weight sync.

Layers: `types` (records, `InferenceEngine`, errors) → `http` (timeouts, retries) →
`client.SGLangEngine` (the protocol; its control routes in `client_control`) →
`pool.EnginePool` (routing, failover; which engines serve, and rejoin, in
`pool_membership`) and `weight_sync` (fan-out refit from disk; `refit` by broadcast) →
`router.RouterEngine` (sgl-model-gateway); `vllm.VLLMEngine` the same protocol over a vLLM
server (its params translated in `vllm_params`); `lora` holds the LoRA adapter calls, the
`active_lora` default of generation and the server flags (`LoraLaunch`), and
`weight_sync.sync_lora_to_engines` pushes adapters; `launch` runs server processes and `supervisor`
relaunches them; `engines.local` is the CPU server itself (imports torch only when it runs);
`engines.testing` holds stand-ins for tests (a gateway imitation, a fault proxy).
Nothing here imports torch, nor `rollouts` or `training`: errors come from `plumbing`.
The exports load on first use (plumbing/lazy.py): `python -m engines.local`, the server, does
not import the client, pool, router and httpx it never uses (~0.06 CPU s of each start).
"""

from typing import TYPE_CHECKING

from plumbing.lazy import lazy_exports

if TYPE_CHECKING:
    from engines.client import SGLangEngine as SGLangEngine
    from engines.client import probe_engines as probe_engines
    from engines.http import EngineTimeouts as EngineTimeouts
    from engines.launch import EngineLaunchError as EngineLaunchError
    from engines.launch import LaunchedEngine as LaunchedEngine
    from engines.launch import find_free_port as find_free_port
    from engines.launch import launch_engine as launch_engine
    from engines.lora import LoraAdapterError as LoraAdapterError
    from engines.lora import LoraLaunch as LoraLaunch
    from engines.pool import EnginePool as EnginePool
    from engines.pool import EngineStats as EngineStats
    from engines.pool import PoolStatistics as PoolStatistics
    from engines.pool import StaleWeightsError as StaleWeightsError
    from engines.refit import RefitGroup as RefitGroup
    from engines.router import RouterEngine as RouterEngine
    from engines.supervisor import Supervision as Supervision
    from engines.supervisor import supervise_engine as supervise_engine
    from engines.types import MIN_SGLANG_VERSION as MIN_SGLANG_VERSION
    from engines.types import EngineTimeoutError as EngineTimeoutError
    from engines.types import EngineUnavailableError as EngineUnavailableError
    from engines.types import FinishReason as FinishReason
    from engines.types import GenerateResult as GenerateResult
    from engines.types import InferenceEngine as InferenceEngine
    from engines.types import ModelInfo as ModelInfo
    from engines.types import PauseMode as PauseMode
    from engines.types import ScoreResult as ScoreResult
    from engines.types import WeightSpan as WeightSpan
    from engines.types import WeightSyncError as WeightSyncError
    from engines.vllm import VLLMEngine as VLLMEngine
    from engines.weight_sync import lora_version_name as lora_version_name
    from engines.weight_sync import pause_engines as pause_engines
    from engines.weight_sync import sync_lora_to_engines as sync_lora_to_engines
    from engines.weight_sync import sync_weights_to_engines as sync_weights_to_engines
    from plumbing.errors import EngineError as EngineError

__getattr__, __all__ = lazy_exports(__name__, __file__)
