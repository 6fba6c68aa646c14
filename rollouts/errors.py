"""The project's error hierarchy, where users import it from (`rollouts.errors`).

The classes live in `plumbing.errors` (every package raises them, and `engines` must not
import `rollouts` to get them); these are the same objects, so `except rollouts.errors.X`
catches what any package raises.
"""

from plumbing.errors import CheckpointError as CheckpointError
from plumbing.errors import ConfigError as ConfigError
from plumbing.errors import DataError as DataError
from plumbing.errors import DropSample as DropSample
from plumbing.errors import EngineError as EngineError
from plumbing.errors import Interrupted as Interrupted
from plumbing.errors import MissingExtraError as MissingExtraError
from plumbing.errors import ModelLoadError as ModelLoadError
from plumbing.errors import RewardError as RewardError
from plumbing.errors import RolloutsError as RolloutsError
from plumbing.errors import describe_engine_failure as describe_engine_failure
from plumbing.errors import engine_failure_kind as engine_failure_kind
from plumbing.errors import import_extra as import_extra
from plumbing.errors import leaf_errors as leaf_errors
