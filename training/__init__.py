"""Learning from data: the SFT and RL loops, their components, configs and recipes.

The names a user needs are here, so `from training import run_rl_training, RLObjective, grpo,
rl_backend` works without knowing the layout. Each loop takes its components, its config and a
few named objects: `RLObjective` (what RL optimizes) and `RLHooks` / `SFTHooks` (who hears of
each step). Layers (each imports only those before it):
`training.data` (JSONL, tokenization, packing, DataBuffer) < `training.backend` (model +
optimizer behind ordered futures, checkpoints) < `training.rl` (advantages, losses, KL,
algorithm presets, one RL step) < `training.loops` (`run_sft_training`, `run_rl_training`,
loggers) < `training.recipes` (config -> components -> loop; the CLI; `train_rl`).
Anything not exported here may change freely.
"""

from typing import TYPE_CHECKING

import plumbing.threads  # noqa: F401  (first: sets OpenMP's wait policy before torch loads)
from plumbing.lazy import lazy_exports

if TYPE_CHECKING:  # the exports, loaded on first use (plumbing/lazy.py)
    from training.backend import BackendError as BackendError
    from training.backend import PyTorchTrainingBackend as PyTorchTrainingBackend
    from training.backend import TrainFuture as TrainFuture
    from training.backend import load_model_and_tokenizer as load_model_and_tokenizer
    from training.backend.checkpoint import find_latest_checkpoint as find_latest_checkpoint
    from training.backend.model_io import load_model as load_model
    from training.backend.model_io import load_tokenizer as load_tokenizer
    from training.backend.tiny_model import ensure_tiny_model as ensure_tiny_model
    from training.config import OptimConfig as OptimConfig
    from training.config import SFTLoopConfig as SFTLoopConfig
    from training.config import SFTRunConfig as SFTRunConfig
    from training.config import load_config as load_config
    from training.data.buffer import DataBuffer as DataBuffer
    from training.data.packing import SFTBatch as SFTBatch
    from training.data.packing import prepare_sft_batch as prepare_sft_batch
    from training.data.sft_data import SFTRecord as SFTRecord
    from training.data.sft_data import load_sft_jsonl as load_sft_jsonl
    from training.data.tokenize import TokenizedSample as TokenizedSample
    from training.data.tokenize import TokenizeStats as TokenizeStats
    from training.data.tokenize import tokenize_conversation as tokenize_conversation
    from training.data.tokenize import tokenize_records as tokenize_records
    from training.loops.hooks import CheckpointHook as CheckpointHook
    from training.loops.hooks import RLHooks as RLHooks
    from training.loops.hooks import SFTHooks as SFTHooks
    from training.loops.hooks import StopFn as StopFn
    from training.loops.loggers import ConsoleLogger as ConsoleLogger
    from training.loops.loggers import JsonlLogger as JsonlLogger
    from training.loops.loggers import Logger as Logger
    from training.loops.loggers import fan_out as fan_out
    from training.loops.loggers import setup_logging as setup_logging
    from training.loops.rl import run_rl_training as run_rl_training
    from training.loops.sft import SFTData as SFTData
    from training.loops.sft import run_sft_training as run_sft_training
    from training.recipes.quick import quick_rl_config as quick_rl_config
    from training.recipes.quick import train_rl as train_rl
    from training.recipes.rl import RLExtensions as RLExtensions
    from training.recipes.rl import RLSummary as RLSummary
    from training.recipes.rl import run_rl_recipe as run_rl_recipe
    from training.recipes.rl_models import rl_backend as rl_backend
    from training.recipes.sft import SFTSummary as SFTSummary
    from training.recipes.sft import run_sft_recipe as run_sft_recipe
    from training.rl.advantages import AdvantageFn as AdvantageFn
    from training.rl.algorithms import AlgorithmConfig as AlgorithmConfig
    from training.rl.algorithms import AlgorithmSchedule as AlgorithmSchedule
    from training.rl.algorithms import PolicyLossFn as PolicyLossFn
    from training.rl.algorithms import cispo as cispo
    from training.rl.algorithms import compute_policy_loss as compute_policy_loss
    from training.rl.algorithms import constant_schedule as constant_schedule
    from training.rl.algorithms import dapo as dapo
    from training.rl.algorithms import distill as distill
    from training.rl.algorithms import dr_grpo as dr_grpo
    from training.rl.algorithms import grpo as grpo
    from training.rl.algorithms import gspo as gspo
    from training.rl.algorithms import online_dpo as online_dpo
    from training.rl.algorithms import ppo as ppo
    from training.rl.algorithms import reinforce_pp as reinforce_pp
    from training.rl.algorithms import rloo as rloo
    from training.rl.algorithms import switch_at as switch_at
    from training.rl.kl import KLFn as KLFn
    from training.rl.objective import RLObjective as RLObjective
    from training.rl.reference import ReferenceUpdateFn as ReferenceUpdateFn
    from training.rl.reference import ema_update as ema_update
    from training.rl.reference import frozen as frozen
    from training.rl_config import RLLoopConfig as RLLoopConfig
    from training.rl_config import RLRunConfig as RLRunConfig

__getattr__, __all__ = lazy_exports(__name__, __file__)
