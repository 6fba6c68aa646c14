"""What a rollout sends with each engine request and reads back: rids and weight versions.

Pure helpers (no trio, no HTTP) shared by the single-turn and multi-turn generate functions.
"""

from __future__ import annotations

from typing import Any


def version_number(version: str | None, default: int) -> int:
    """Engines report weight versions as strings; ours are integers ("12")."""
    return int(version) if version is not None and version.isdigit() else default


def oldest_version(result: Any) -> int:
    """The oldest weight version that produced any token of `result`.

    A request that spans a weight update (pause "in_place"/"retract") reports one span per
    version in `meta_info.weight_versions`; `weight_version` is then the newest one, which would
    make the sample look fresher than its first tokens are.
    """
    spans = getattr(result, "weight_versions", ()) or ()
    numbers = [version_number(s.version, 0) for s in spans if s.end > s.start]
    if numbers:
        return min(numbers)
    return version_number(result.weight_version, 0)


def request_rid(prefix: str, *parts: object) -> str:
    """A request id that is never a prefix of another one made here.

    SGLang's `/abort_request` aborts every rid that *starts with* the given one ("r-g1-1" would
    also abort "r-g1-10"); the closing "." appears nowhere else in a rid, so no rid is a prefix
    of another.
    """
    return "-".join([prefix, *map(str, parts)]) + "."
