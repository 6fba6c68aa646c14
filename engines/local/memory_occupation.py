"""SGLang's `/release_memory_occupation` and `/resume_memory_occupation` on the local engine, for
real: the weights' and the KV cache's memory is freed and taken again (CPU and CUDA alike).

Why: in colocated mode (`engines.colocate: true`) the engine and the trainer share one node's
memory; the engine gives its memory back while the trainer trains, and takes it again before
the new weights are loaded into it (issue 47 item 3).

Contract (SGLang 0.5.x with `--enable-memory-saver` and without `--enable-weights-cpu-backup`,
whose RL users always load new weights after a resume):
- A body `{"tags": [...]}` names what to release or resume: "weights", "kv_cache" (and
  "cuda_graph", accepted: the local engine has none); no tags (or `{}`) means all. Other tags
  are a 400.
- Release needs an idle engine (no request running or queued): 400 otherwise, nothing done.
  From that check on (while it waits for the model thread and runs there) requests and loads
  are refused as when released: one queued meanwhile would run on the freed weights.
  "weights": every parameter's storage is dropped (its shape and dtype kept); "kv_cache": the
  running batch's cache and the prefix cache are dropped. The allocator is then asked to give
  the memory back (CUDA's cache, glibc's `malloc_trim`), so the process's RSS falls.
- While anything is released, and after "weights" were resumed until weights are loaded, a
  request is refused with a 400 naming what to call; a weight load while the weights are
  released is refused too (resume first): the resumed storage holds no weights until a load.
- Resume of "weights" takes the memory again (uninitialised, as SGLang without a CPU backup);
  of "kv_cache": nothing to take ahead (the local engine allocates KV per batch). Releasing
  what is released, or resuming what is not, is a no-op (SGLang asserts; a retried call must
  not fail here).
- `memory_usage(runner)` is what `/get_server_info` reports under `internal_states[0]
  ["memory_usage"]`, in GiB: "weight" (SGLang's key: the parameters' storage held, 0 while
  released) and, on CUDA, the caching allocator's "allocated", "reserved" and
  "peak_allocated" (the most allocated since the last release or resume: a generation's
  weights + KV peak when read before the release; not SGLang's keys). Colocated runs log them
  per phase (training/loops/colocate.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from .sampling_params import BadRequestError

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")
ACCEPTED = (*TAGS, "cuda_graph")


def parse_tags(body: Any) -> tuple[str, ...]:
    """The tags of a release/resume body (all when none are named). Raises BadRequestError."""
    tags = body.get("tags") if isinstance(body, dict) else None
    if tags is None:
        return TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadRequestError(f"tags must be a list of strings, got {tags!r}")
    unknown = [t for t in tags if t not in ACCEPTED]
    if unknown:
        raise BadRequestError(f"unknown memory tags {unknown}; expected some of {list(ACCEPTED)}")
    return tuple(t for t in TAGS if t in tags)


class MemoryOccupation:
    """What the engine has released (see the module docstring); one per scheduler."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.released: set[str] = set()
        self.releasing: set[str] = set()  # a release checked the engine idle and runs now
        self.awaiting_weights = False  # resumed weights hold nothing until a load
        self._shapes: list[tuple[Any, Any, Any]] = []  # (parameter, shape, dtype) released

    def check_serving(self) -> None:
        """Raise BadRequestError when a request cannot be served (released or no weights)."""
        if gone := self.released | self.releasing:
            raise BadRequestError(
                f"this engine's {' and '.join(sorted(gone))} memory is released "
                "(/release_memory_occupation): call /resume_memory_occupation and load weights "
                "before generating"
            )
        if self.awaiting_weights:
            raise BadRequestError(
                "this engine's weights were released and resumed: load weights "
                "(/update_weights_from_disk or a distributed update) before generating"
            )

    def load_refused(self) -> str | None:
        """Why a weight load is refused now, or None."""
        if "weights" in self.released | self.releasing:
            return ("Failed to update weights: the weights' memory is released "
                    "(/release_memory_occupation); call /resume_memory_occupation first.")  # fmt: skip
        return None

    @contextlib.contextmanager
    def releasing_now(self, tags: Iterable[str]) -> Iterator[None]:
        """Around a release, from its idle check to its end (module docstring)."""
        tags = set(tags)
        self.releasing |= tags
        try:
            yield
        finally:
            self.releasing -= tags

    def weights_loaded(self) -> None:
        self.awaiting_weights = False

    def release(self, tags: Iterable[str]) -> None:
        """Free the memory of `tags` (model thread, engine idle)."""
        import torch

        tags = [t for t in tags if t not in self.released]
        if "weights" in tags:
            model = self.runner.model
            self._shapes = [(p, p.shape, p.dtype) for p in model.parameters()]
            for param, _, dtype in self._shapes:
                param.data = torch.empty(0, dtype=dtype, device=param.device)
        if "kv_cache" in tags:
            self.runner.reset()
            self.runner.prefix.clear()
        self.released.update(tags)
        _give_back(self.runner.device)
        _reset_peak(self.runner.device)
        logger.info("released the memory of %s; now %s", ", ".join(tags) or "nothing new",
                    memory_usage(self.runner))  # fmt: skip

    def resume(self, tags: Iterable[str]) -> None:
        """Take the memory of `tags` again (model thread)."""
        import torch

        tags = [t for t in tags if t in self.released]
        if "weights" in tags:
            for param, shape, dtype in self._shapes:
                param.data = torch.empty(shape, dtype=dtype, device=param.device)
            self._shapes = []
            self.awaiting_weights = True
            self.runner.prefix.new_generation()  # no KV of the weights before is reused
        self.released.difference_update(tags)
        _reset_peak(self.runner.device)
        logger.info("resumed the memory of %s; now %s", ", ".join(tags) or "nothing released",
                    memory_usage(self.runner))  # fmt: skip


def _give_back(device: Any) -> None:
    """Return freed memory to the system: CUDA's caching allocator, glibc's free lists."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def memory_usage(runner: Any) -> dict[str, float]:
    """The engine's memory now, in GiB (module docstring); any thread may call it."""
    import torch

    held = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    usage = {"weight": round(held / 2**30, 4)}
    device = runner.device
    if device.type == "cuda":
        usage |= {
            "allocated": round(torch.cuda.memory_allocated(device) / 2**30, 4),
            "reserved": round(torch.cuda.memory_reserved(device) / 2**30, 4),
            "peak_allocated": round(torch.cuda.max_memory_allocated(device) / 2**30, 4),
        }
    return usage


def _reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
