"""The project's error hierarchy.

One base class, a few precise subclasses that also inherit the stdlib type they replace, so
callers can catch either `RolloutsError` or the familiar builtin (`except ValueError`).
Messages say what happened, where (file, line, field, engine URL) and what to do.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class RolloutsError(Exception):
    """Base class for every error raised on purpose by rollouts, training and engines."""


class ConfigError(RolloutsError, ValueError):
    """A config file, override or argument is invalid (names the key)."""


class DataError(RolloutsError, ValueError):
    """Input data is malformed (names the file, line and field)."""


class ModelLoadError(RolloutsError, OSError):
    """A model or tokenizer directory cannot be loaded (names the path)."""


class CheckpointError(RolloutsError, OSError):
    """A checkpoint is missing, incomplete or does not match the run."""


class EngineError(RolloutsError, RuntimeError):
    """An inference engine answered with an error or could not be reached.

    Carries the engine's URL, the HTTP status (None when there was no answer) and the
    server's response body, so the message shows what the server said.
    """

    def __init__(self, message: str, *, url: str = "", status: int | None = None, body: str = ""):
        detail = message
        if url:
            detail = f"{url}: {detail}"
        if status is not None:
            detail = f"{detail} (HTTP {status})"
        if body:
            detail = f"{detail}: {body[:2000]}"
        super().__init__(detail)
        self.url = url
        self.status = status
        self.body = body


def engine_failure_kind(exc: BaseException) -> str:
    """ "unreachable", "stalled", "timeout", "stale weights", "gave up after <kind>" or "HTTP <status>" (engines' error classes are
    matched by name: this module is below `engines`)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "StaleWeightsError" in names:
        return "stale weights"
    if "NoEngineAvailableError" in names:  # the pool retried until its bound
        return f"gave up after {getattr(exc, 'last_kind', None) or 'no engine'}"
    if "EngineStalledError" in names:  # the pool's bound from max_new_tokens, not the HTTP one
        return "stalled"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if "EngineUnavailableError" in names:
        return "unreachable"
    status = getattr(exc, "status", None)
    return f"HTTP {status}" if status is not None else type(exc).__name__


def describe_engine_failure(exc: BaseException) -> str:
    """ "<engine url>: <kind>", as failure counts name them."""
    return f"{getattr(exc, 'url', '') or 'engine'}: {engine_failure_kind(exc)}"


class RewardError(RolloutsError, RuntimeError):
    """A reward function raised or timed out under a fail-fast policy."""


class MissingExtraError(RolloutsError, ImportError):
    """An optional dependency is not installed; names the extra that provides it."""

    def __init__(self, package: str, extra: str, feature: str):
        super().__init__(
            f"{feature} needs the {package!r} package, which is not installed; "
            f"install it with: pip install 'rollouts[{extra}]'"
        )
        self.package = package
        self.extra = extra


def import_extra(module: str, *, package: str, extra: str, feature: str) -> ModuleType:
    """Import an optional dependency, or raise MissingExtraError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(package, extra, feature) from err


class DropSample(RolloutsError):
    """Raised by a reward to say its sample must not be trained on (e.g. a judge that cannot
    parse the answer): the sample is regenerated (`rollout.sample_retries`), and its group is
    dropped if that fails too. Any other exception from a reward does the same by default, but
    is counted as a failed reward (`reward_failed`); with `rollout.reward_failure_value` set it
    gives the sample that value instead, records the error on it and keeps its group."""


class Interrupted(Exception):
    """The run was stopped by a signal (`signal_name`, e.g. SIGINT): not an error of the run.

    Here, not in the CLI, because rank 0 of a torchrun job must tell a stop that the user asked
    for from one that torchrun sent because another rank died (training/distributed/liveness.py).
    """

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; `exc` itself if not a group."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaf_errors(inner)]
    return [exc]
