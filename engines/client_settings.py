"""The settings a run's engine clients and their pool are built with, as one JSON-ready mapping.

The trainer's clients (training/recipes/rl_engines.py) and each rollout worker's
(rollouts/workers/worker.py, which gets the mapping in its start frame) are built from it by the
same two functions, so a setting in the run's `engines:` section bounds a worker's requests as it
bounds the trainer's:
- `client_settings(engines_config)`: the fields of `EnginesConfig` (or any object with them) that
  the clients and the pool read, as a plain dict (JSON: it crosses a pipe, never pickled);
- `client_options(settings)`: `SGLangEngine`'s (and `VLLMEngine`'s) keyword arguments: the keys
  and `EngineTimeouts` (`generate_timeout_s`, the weight-load bound);
- `pool_options(settings)`: `EnginePool`'s: how long a request waits for an engine to come back
  (`unavailable_timeout_s`) and the stall bound (`stall_floor_s`, `stall_s_per_token`).
A key missing from `settings` keeps the library default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .http import DEFAULT_TIMEOUTS, EngineTimeouts

CLIENT_FIELDS = ("api_key", "admin_api_key", "generate_timeout_s", "weight_update_floor_s",
                 "weight_update_s_per_gb")  # fmt: skip
POOL_FIELDS = ("unavailable_timeout_s", "stall_floor_s", "stall_s_per_token")


def client_settings(engines_config: Any) -> dict[str, Any]:
    """The clients' and pool's fields of `engines_config` (an `EnginesConfig`), JSON-ready."""
    return {name: getattr(engines_config, name) for name in CLIENT_FIELDS + POOL_FIELDS}


def client_timeouts(settings: Mapping[str, Any]) -> EngineTimeouts:
    """The clients' `EngineTimeouts`: the settings' bounds, the library's for the rest."""
    d = DEFAULT_TIMEOUTS
    return EngineTimeouts(
        generate_s=settings.get("generate_timeout_s", d.generate_s),
        weight_update_floor_s=settings.get("weight_update_floor_s", d.weight_update_floor_s),
        weight_update_s_per_gb=settings.get("weight_update_s_per_gb", d.weight_update_s_per_gb),
    )


def client_options(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of an engine client (`SGLangEngine(url, **client_options(s))`)."""
    return {"api_key": settings.get("api_key"), "admin_api_key": settings.get("admin_api_key"),
            "timeouts": client_timeouts(settings)}  # fmt: skip


def pool_options(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the `EnginePool` over those clients (the keys present only)."""
    return {name: settings[name] for name in POOL_FIELDS if name in settings}
