"""Hugging Face's save progress bars off for the length of a save, and only for it.

`save_pretrained` draws a "Writing model shards" tqdm bar per call; the trainer saves at every
weight sync and checkpoint, so a run's console was mostly these bars (107 lines in 30 s of
`train_rl`). transformers has one global switch for its bars; turning it off for good would
change a setting that belongs to the program using this library, so it is turned off around
each save and turned back on after the last overlapping save ends (saves run on the backend's
worker thread while the program may save from another: the switch is reference-counted).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_restore = False  # whether the bars were on when the outermost save began


@contextlib.contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """Silence transformers' progress bars inside the block; restore the setting after it."""
    global _depth, _restore
    from transformers.utils import logging as hf_logging

    with _lock:
        if _depth == 0:
            _restore = hf_logging.is_progress_bar_enabled()
            if _restore:
                hf_logging.disable_progress_bar()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _restore:
                hf_logging.enable_progress_bar()
