"""`serve_env_app`: an OpenEnv server for the length of an `async with`, on 127.0.0.1.

`env.openenv.app: module:attribute` names a FastAPI app built by OpenEnv's `create_app`; the
recipe runs `python -m uvicorn module:attribute --host 127.0.0.1 --port P` (imported from the
working directory, under `engines.orphan_guard` so a SIGKILLed trainer leaves no server behind)
and yields its URL once `GET /health` answers 200. A process that exits first, or no health
within `startup_timeout_s`, raises `OpenEnvError` with the tail of its log. When the block
exits (also by an error or cancellation) the server gets SIGTERM, then its process group
SIGKILL after 10 s; the block does not exit before it is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import trio

from engines.launch import find_free_port, log_tail
from plumbing.nursery import open_nursery
from rollouts.openenv.wire import OpenEnvError

log = logging.getLogger(__name__)
_ROOT = str(Path(__file__).resolve().parent.parent.parent)  # `engines` importable in the child


@dataclass(frozen=True)
class ServedApp:
    url: str
    pid: int  # the guard's: the leader of the server's process group
    log_path: Path


async def _stop(process: trio.Process, timeout_s: float = 10.0) -> None:
    process.send_signal(signal.SIGTERM)  # the guard passes it on to uvicorn
    with trio.move_on_after(timeout_s) as scope:
        await process.wait()
    if scope.cancelled_caught:
        log.warning("env server pid %d ignored SIGTERM for %.0f s; killing it", process.pid,
                    timeout_s)  # fmt: skip
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


@asynccontextmanager
async def serve_env_app(app: str, *, startup_timeout_s: float = 120.0,
                        log_path: str | os.PathLike[str] | None = None,
                        env: Mapping[str, str] | None = None
                        ) -> AsyncIterator[ServedApp]:  # fmt: skip
    """Serve the OpenEnv app `module:attribute` on a free loopback port; yield its URL and pid.

    Args:
        log_path: the server's output (default: a temp file, removed after a clean stop).
        env: extra environment variables for the server process.

    Raises:
        OpenEnvError: the server exited or was not healthy within `startup_timeout_s`.
    """
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "engines.orphan_guard", str(os.getpid()), "--",
            sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
            "--app-dir", os.getcwd(), "--log-level", "warning"]  # fmt: skip
    temp_log = log_path is None
    if temp_log:
        fd, name = tempfile.mkstemp(prefix=f"openenv-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    out = Path(log_path)
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, child_env.get("PYTHONPATH")]))
    log.info("serving OpenEnv app %s at %s (log: %s)", app, url, out)
    with out.open("ab") as log_file:
        run = partial(trio.run_process, argv, stdin=subprocess.DEVNULL, stdout=log_file,
                      stderr=subprocess.STDOUT, check=False, env=child_env,
                      start_new_session=True, deliver_cancel=_stop)  # fmt: skip
        stop = trio.CancelScope(shield=True)  # stopped when the block is left, not before

        async def run_until_stopped(task_status: trio.TaskStatus[trio.Process]) -> None:
            with stop:
                await run(task_status=task_status)

        async with open_nursery() as nursery:
            process: trio.Process = await nursery.start(run_until_stopped)
            try:
                await _wait_until_healthy(process, app, url, out, startup_timeout_s)
                yield ServedApp(url, process.pid, out)
            finally:
                stop.cancel()
    log.info("OpenEnv server %s stopped", url)
    if temp_log:
        out.unlink(missing_ok=True)


async def _wait_until_healthy(process: trio.Process, app: str, url: str, out: Path,
                              timeout_s: float) -> None:  # fmt: skip
    deadline = trio.current_time() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=5.0, trust_env=False) as client:
        while True:
            if process.returncode is not None:
                raise OpenEnvError(
                    f"{url}: the OpenEnv server for env.openenv.app={app} exited with code "
                    f"{process.returncode} before answering /health; log {out} ends with:\n"
                    f"{log_tail(out)}"
                )
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                if (await client.get("/health")).status_code == 200:
                    return
            if trio.current_time() > deadline:
                raise OpenEnvError(
                    f"{url}: the OpenEnv server for env.openenv.app={app} did not answer /health "
                    f"within {timeout_s} s (env.openenv.startup_timeout_s); log {out} ends "
                    f"with:\n{log_tail(out)}"
                )
            await trio.sleep(0.25)
