"""The loops: `run_sft_training` and `run_rl_training`, pure async functions over the stateful
components, plus their hooks (`RLHooks`, `SFTHooks`: logger, evaluation, stop, callbacks),
loggers and held-out evaluation. What RL optimizes is `training.rl.objective.RLObjective`.

Layer: above `training.rl` and `training.backend`; the recipes (config → wiring) call these.
"""

from typing import TYPE_CHECKING

from plumbing.lazy import lazy_exports

if TYPE_CHECKING:  # the exports, loaded on first use (plumbing/lazy.py)
    from training.loops.hooks import CheckpointHook as CheckpointHook
    from training.loops.hooks import EvaluateFn as EvaluateFn
    from training.loops.hooks import RLHooks as RLHooks
    from training.loops.hooks import SFTEvaluateFn as SFTEvaluateFn
    from training.loops.hooks import SFTHooks as SFTHooks
    from training.loops.hooks import StopFn as StopFn
    from training.loops.loggers import ConsoleLogger as ConsoleLogger
    from training.loops.loggers import JsonlLogger as JsonlLogger
    from training.loops.loggers import Logger as Logger
    from training.loops.loggers import TensorBoardLogger as TensorBoardLogger
    from training.loops.loggers import WandbLogger as WandbLogger
    from training.loops.loggers import fan_out as fan_out
    from training.loops.loggers import setup_logging as setup_logging
    from training.loops.rl import run_rl_training as run_rl_training
    from training.loops.run_length import sft_run_length as sft_run_length
    from training.loops.sft import SFTData as SFTData
    from training.loops.sft import run_sft_training as run_sft_training

__getattr__, __all__ = lazy_exports(__name__, __file__)
