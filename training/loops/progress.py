"""Honest progress for the per-step console line: elapsed time, an ETA, and a flat-step note.

A person reading a log file (no terminal, so no tqdm bar) needs on every step's line how far
the phase is, how long it has taken and how long it will still take; the ETA is the mean step
time so far, so it follows the machine's load (SFT on a busy machine slows by the load factor).
Also here: the scoped console handler `train_rl` installs when the caller has configured no
logging at all (a library must not change a program's logging for good, but a one-call helper
that prints nothing for a minute is worse).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def format_duration(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` from an hour on."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Eta:
    """Elapsed time and remaining-time estimate of a phase of `total` steps.

    Elapsed counts from when it is made (just before the phase: set-up included). The rate
    counts from the first step described: set-up (engine launch, a first evaluation) is not a
    step's time, and a resumed phase (first step 401 of 800) is not credited with the steps an
    earlier run did. The first step's line has no estimate (its time includes the set-up).

    A phase capped by time (`max_wall_s`, counted from when it is made: the SFT loop counts its
    `train.max_wall_s` from just after) ends at whichever comes first: its estimate is the
    smaller of the steps-based one and the time left before the cap, and then says so
    (`~2:05 left (time cap)`), not the hours its 100,000 capped steps would take.
    """

    def __init__(self, total: int, *, max_wall_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.total = total
        self.max_wall_s = max_wall_s
        self._clock = clock
        self._t0 = clock()
        self._first: tuple[int, float] | None = None  # (step, when it was described)

    def describe(self, step: int) -> str:
        """`elapsed 1:02, ~10:40 left` after `step` of `total`."""
        now = self._clock()
        elapsed = f"elapsed {format_duration(now - self._t0)}"
        if self._first is None:
            self._first = (step, now)
        first, at = self._first
        if step >= self.total or step <= first:
            return elapsed
        per_step = (now - at) / (step - first)
        left = per_step * (self.total - step)
        if self.max_wall_s is not None and self.max_wall_s - (now - self._t0) < left:
            capped = self.max_wall_s - (now - self._t0)
            return f"{elapsed}, ~{format_duration(capped)} left (time cap)"
        return f"{elapsed}, ~{format_duration(left)} left"


def signal_note(metrics: Mapping[str, Any]) -> str:
    """The words a flat RL step's line carries (`training/rl/signal.py`), else ''."""
    if metrics.get("no_signal"):
        return "NO SIGNAL (every group's rewards equal)"
    return ""


@contextlib.contextmanager
def console_logging_if_unconfigured(level: int = logging.INFO) -> Iterator[None]:
    """Print the `rollouts` loggers' lines on stderr for the block, if nothing else would.

    When the program has configured logging (a handler on `rollouts` or the root logger) this
    does nothing: its configuration decides. Otherwise a handler is attached for the block and
    removed after it, so the program's logging is left as it was.
    """
    logger = logging.getLogger("rollouts")
    if logger.hasHandlers():
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
