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
"""

from plumbing.errors import EngineError as EngineError

from .client import SGLangEngine as SGLangEngine
from .client import probe_engines as probe_engines
from .http import EngineTimeouts as EngineTimeouts
from .launch import EngineLaunchError as EngineLaunchError
from .launch import LaunchedEngine as LaunchedEngine
from .launch import find_free_port as find_free_port
from .launch import launch_engine as launch_engine
from .lora import LoraAdapterError as LoraAdapterError
from .lora import LoraLaunch as LoraLaunch
from .pool import EnginePool as EnginePool
from .pool import EngineStats as EngineStats
from .pool import PoolStatistics as PoolStatistics
from .pool import StaleWeightsError as StaleWeightsError
from .refit import RefitGroup as RefitGroup
from .router import RouterEngine as RouterEngine
from .supervisor import Supervision as Supervision
from .supervisor import supervise_engine as supervise_engine
from .types import MIN_SGLANG_VERSION as MIN_SGLANG_VERSION
from .types import EngineTimeoutError as EngineTimeoutError
from .types import EngineUnavailableError as EngineUnavailableError
from .types import FinishReason as FinishReason
from .types import GenerateResult as GenerateResult
from .types import InferenceEngine as InferenceEngine
from .types import ModelInfo as ModelInfo
from .types import PauseMode as PauseMode
from .types import ScoreResult as ScoreResult
from .types import WeightSpan as WeightSpan
from .types import WeightSyncError as WeightSyncError
from .vllm import VLLMEngine as VLLMEngine
from .weight_sync import lora_version_name as lora_version_name
from .weight_sync import pause_engines as pause_engines
from .weight_sync import sync_lora_to_engines as sync_lora_to_engines
from .weight_sync import sync_weights_to_engines as sync_weights_to_engines
