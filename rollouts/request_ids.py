"""What a rollout sends with each engine request and reads back: rids and weight versions.

Pure helpers (no trio, no HTTP) shared by the single-turn and multi-turn generate functions.

Rids are unique per request for the life of a run, resumes included: each batch's requests
share a prefix from `RidPrefixes` (a random token per owner, so a resumed run or a second
manager never repeats one, and a counter per batch, so async mode's producer and overlap mode's
prefetch never do), and within a batch a rid names its group, attempt, sample and turn/call.
The local engine, like SGLang, aborts every in-flight request whose rid starts with the one
given: a reused rid would let one abort hit two requests.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any


class RidPrefixes:
    """`next()`: "<kind><n>-<token>", n counting from 1 and the token random per instance."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.token = secrets.token_hex(4)
        self._count = itertools.count(1)

    def next(self) -> str:
        return f"{self.kind}{next(self._count)}-{self.token}"


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
