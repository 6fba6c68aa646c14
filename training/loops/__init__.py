"""The loops: `run_sft_training` and `run_rl_training`, pure async functions over the stateful
components, plus their loggers and held-out evaluation.

Layer: above `training.rl` and `training.backend`; the recipes (config → wiring) call these.
"""

from training.loops.loggers import ConsoleLogger as ConsoleLogger
from training.loops.loggers import JsonlLogger as JsonlLogger
from training.loops.loggers import Logger as Logger
from training.loops.loggers import TensorBoardLogger as TensorBoardLogger
from training.loops.loggers import WandbLogger as WandbLogger
from training.loops.loggers import fan_out as fan_out
from training.loops.loggers import setup_logging as setup_logging
from training.loops.rl import CheckpointHook as CheckpointHook
from training.loops.rl import StopFn as StopFn
from training.loops.rl import run_rl_training as run_rl_training
from training.loops.sft import SFTData as SFTData
from training.loops.sft import run_sft_training as run_sft_training
