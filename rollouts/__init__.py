"""Producing and scoring trajectories: errors, tasks/environments, rewards, rollout managers.

This package imports neither torch nor httpx at top level, so orchestration code that only
needs records and errors stays cheap to import.
"""

from rollouts.errors import CheckpointError as CheckpointError
from rollouts.errors import ConfigError as ConfigError
from rollouts.errors import DataError as DataError
from rollouts.errors import EngineError as EngineError
from rollouts.errors import ModelLoadError as ModelLoadError
from rollouts.errors import RewardError as RewardError
from rollouts.errors import RolloutsError as RolloutsError
