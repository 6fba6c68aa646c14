"""`WorkerProcess`: one rollout worker as seen from the trainer: started, asked, restarted.

The process runs under a nursery the caller owns (`trio.run_process` via `nursery.start`), so
cancelling that nursery ends it. `ask` sends one request frame and waits, under a deadline, for
its answer; a worker that died (its stdout ended, a truncated frame) or did not answer in time
raises `WorkerLost`, and `restart` starts a fresh process over the same engines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import trio

from plumbing.errors import RolloutsError
from rollouts.config import RolloutConfig
from rollouts.workers.frames import FrameError, FrameReader, encode_frame

ROOT = Path(__file__).resolve().parents[2]  # the folder holding the `rollouts` package


class WorkerLost(RolloutsError):
    """A worker died or stopped answering before it returned its groups."""


class WorkerProcess:
    """See the module docstring."""

    def __init__(self, index: int, engine_urls: list[str], rollout: RolloutConfig, reward: str,
                 *, timeout_s: float, start_timeout_s: float = 120.0,
                 engines: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        self.index = index
        self.engine_urls = list(engine_urls)
        # `engines`: the run's client and pool settings (engines/client_settings.py)
        self.start_frame = {"kind": "start", "worker": index, "engine_urls": self.engine_urls,
                            "rollout": rollout.model_dump(mode="json"), "reward": reward,
                            "engines": dict(engines or {})}  # fmt: skip
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.process: trio.Process | None = None
        self.pid: int | None = None
        self.starts = 0
        self._reader: FrameReader | None = None
        self._send_lock = trio.Lock()  # `tell` may send while `ask` waits for its answer
        self.ready = False  # the process answered its start frame (the first frame it reads)

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the process under `nursery` and wait for its "ready" frame."""
        self.ready = False  # nothing may reach the new process before its start frame
        # the worker imports what this process can (a reward next to the config included)
        path = [str(ROOT), *(p for p in sys.path if p and os.path.isdir(p))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}
        self.process = await nursery.start(partial(
            trio.run_process, [sys.executable, "-m", "rollouts.workers.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, check=False, env=env))  # fmt: skip
        self.starts += 1
        self._reader = FrameReader(
            self.process.stdout, what=f"rollout worker {self.index}'s stdout"
        )
        ready = await self._exchange(self.start_frame, self.start_timeout_s, "start")
        if ready[0].get("kind") != "ready":
            raise WorkerLost(f"rollout worker {self.index} answered its start with {ready[0]!r}")
        self.pid = ready[0]["pid"]
        self.ready = True

    async def restart(self, nursery: trio.Nursery) -> None:
        self.kill()
        await self.start(nursery)

    def kill(self) -> None:
        self.ready = False
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    async def ask(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[np.ndarray]]:
        """Send `request`; its answer (header, buffers).

        Raises:
            WorkerLost: the worker died, or gave no answer within `timeout_s`.
            RolloutsError: the worker answered with an error (not worth a retry).
        """
        header, buffers = await self._exchange(request, self.timeout_s, "groups")
        if header.get("kind") == "error":
            raise RolloutsError(f"rollout worker {self.index} (engines "
                                f"{', '.join(self.engine_urls)}): {header['message']}")  # fmt: skip
        return header, buffers

    async def tell(self, frame: dict[str, Any], timeout_s: float = 5.0) -> bool:
        """Send a frame the worker does not answer (the engines the trainer has paused), also
        while an `ask` waits; False when no started worker is there to read it within
        `timeout_s` (one being started or restarted is told again with its next request)."""
        process = self.process
        if not self.ready or process is None or process.stdin is None:
            return False
        with trio.move_on_after(timeout_s):
            try:
                async with self._send_lock:
                    await process.stdin.send_all(encode_frame(frame))
                return True
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
        return False

    async def _exchange(self, frame: dict[str, Any], timeout_s: float, what: str
                        ) -> tuple[dict[str, Any], list[np.ndarray]]:  # fmt: skip
        assert self.process is not None and self._reader is not None
        stdin = self.process.stdin
        assert stdin is not None
        try:
            with trio.fail_after(timeout_s):
                async with self._send_lock:
                    await stdin.send_all(encode_frame(frame))
                answer = await self._reader.receive()
        except trio.TooSlowError:
            raise WorkerLost(f"rollout worker {self.index} (pid {self.process.pid}) gave no "
                             f"{what} answer within {timeout_s} s (rollout.worker_timeout_s): "
                             "are its engines answering?") from None  # fmt: skip
        except (FrameError, trio.BrokenResourceError, trio.ClosedResourceError) as err:
            raise WorkerLost(f"rollout worker {self.index} (pid {self.process.pid}) died: "
                             f"{err}") from err  # fmt: skip
        if answer is None:
            code = await self._exit_code()
            raise WorkerLost(f"rollout worker {self.index} (pid {self.process.pid}) ended "
                             f"(exit code {code}) before its {what} answer; its stderr says why")  # fmt: skip
        return answer

    async def _exit_code(self) -> int | None:
        assert self.process is not None
        with trio.move_on_after(5):
            return await self.process.wait()
        return self.process.returncode
