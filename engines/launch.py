"""`launch_engine`: run an inference server process for the duration of an `async with`.

Contract:
- Starts `python -m sglang.launch_server ...` (kind="sglang"), `python -m engines.local ...`
  (kind="local", same flag names) or your own command, under trio, on a free loopback port
  unless `port` is given (a port it picked that another process binds first: it picks
  another, up to 3 tries); the process's stdout and stderr go to `log_path`.
- Yields a `LaunchedEngine` only after `GET /health_generate` answered 200. If the process exits
  first or the deadline passes, raises `EngineLaunchError` with the tail of its log.
- Engines die with this process, even when it is SIGKILLed: the local engine watches its parent
  (`ROLLOUTS_PARENT_PID`) and exits when it is gone; kind="sglang" runs under
  `engines.orphan_guard`, which kills the server's whole process group then. (`PR_SET_PDEATHSIG`
  cannot be used: trio starts the process from a worker thread, and the signal fires when that
  thread exits.)
- `LaunchedEngine.exited` is set when the process ends on its own (`engines.supervisor`
  relaunches it).
- When the block exits — normally, by an exception, or by cancellation (also mid-start) — the
  process gets SIGTERM, then SIGKILL after `terminate_timeout_s`; the block does not exit
  before the process is gone.

Not covered: process groups (a server that forks workers must stop them on SIGTERM itself,
as SGLang does), restarting a crashed server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import httpx
import trio

from plumbing.errors import EngineError
from plumbing.nursery import open_nursery

from .lora import LoraLaunch

logger = logging.getLogger(__name__)

_MODULES = {"sglang": "sglang.launch_server", "local": "engines.local"}


class EngineLaunchError(EngineError):
    """The server process died or did not become healthy in time (message has its log tail)."""


@dataclass(frozen=True)
class LaunchedEngine:
    url: str
    port: int
    pid: int
    log_path: Path
    command: tuple[str, ...]
    exited: trio.Event = field(default_factory=trio.Event, compare=False)  # the process ended


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS may hand it out again; bind soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def build_command(
    kind: Literal["sglang", "local"],
    model_path: str,
    host: str,
    port: int,
    extra_args: Sequence[str] = (),
    command: Sequence[str] | None = None,
) -> list[str]:
    """The server command line: the program, then `--model-path --host --port`, then extras."""
    prefix = list(command) if command else [sys.executable, "-m", _MODULES[kind]]
    return [
        *prefix,
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        *extra_args,
    ]


async def _terminate(process: trio.Process, timeout_s: float, group: bool = False) -> None:
    """trio.run_process's deliver_cancel: SIGTERM, then SIGKILL (to the group) if it lingers."""
    process.send_signal(signal.SIGTERM)
    with trio.move_on_after(timeout_s) as scope:
        await process.wait()
    if scope.cancelled_caught:
        logger.warning(
            "engine pid %d ignored SIGTERM for %.0f s; killing it", process.pid, timeout_s
        )
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.kill()


@asynccontextmanager
async def launch_engine(
    command: Sequence[str] | None = None,
    *,
    kind: Literal["sglang", "local"] = "local",
    model_path: str | os.PathLike[str],
    port: int | None = None,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    log_path: str | os.PathLike[str] | None = None,
    startup_timeout_s: float = 600.0,
    terminate_timeout_s: float = 10.0,
    poll_interval_s: float = 0.5,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    lora: LoraLaunch | None = None,
) -> AsyncIterator[LaunchedEngine]:
    """Start an engine server process, wait until it is healthy, stop it on exit.

    Args:
        command: program prefix replacing `python -m <module>` (e.g. `["sglang", "serve"]`).
        kind: "local" (this project's CPU engine) or "sglang".
        model_path: model directory (or HF id for SGLang).
        port: None picks a free port.
        extra_args: more server flags, e.g. `["--weight-version", "v0"]`.
        log_path: where the server's output goes (default: a temp file, removed when the
            engine stops without an error; a failed start names it in the error).
        api_key: passed as `--api-key` and used for the health check.
        admin_api_key: passed as `--admin-api-key` (the key of the control routes).
        cwd: the server's working directory (default: ours); relative paths sent to it are
            resolved there, which is why the client sends absolute ones.
        lora: serve LoRA adapters: `--enable-lora --max-lora-rank R --lora-target-modules ...
            --max-loras-per-batch K` (the same flags for SGLang and the local engine).

    Raises:
        EngineLaunchError: the process exited or was not healthy within `startup_timeout_s`.
    """
    launch = partial(_launch, command, kind=kind, model_path=model_path, host=host,
                     extra_args=extra_args, log_path=log_path, startup_timeout_s=startup_timeout_s,
                     terminate_timeout_s=terminate_timeout_s, poll_interval_s=poll_interval_s,
                     api_key=api_key, admin_api_key=admin_api_key, env=env, cwd=cwd, lora=lora)  # fmt: skip
    for attempt in range(1, _PORT_TRIES + 1):
        started = False
        try:
            async with launch(port=port or find_free_port(host)) as launched:
                started = True
                yield launched
            return
        except EngineLaunchError as exc:
            # a port we picked was free then; another process may bind it before the server
            # does (after its imports, seconds later): pick another rather than fail the run
            if started or port is not None or attempt == _PORT_TRIES or not _port_taken(exc):
                raise
            logger.warning("the engine's port was taken before it bound it: picking another "
                           "(%s)", str(exc).splitlines()[0])  # fmt: skip


_PORT_TRIES = 3


def _port_taken(exc: EngineLaunchError) -> bool:
    return "address already in use" in str(exc).lower()


@asynccontextmanager
async def _launch(command: Sequence[str] | None, *, kind: Literal["sglang", "local"],
                  model_path: str | os.PathLike[str], port: int, host: str,
                  extra_args: Sequence[str], log_path: str | os.PathLike[str] | None,
                  startup_timeout_s: float, terminate_timeout_s: float, poll_interval_s: float,
                  api_key: str | None, admin_api_key: str | None, env: dict[str, str] | None,
                  cwd: str | os.PathLike[str] | None, lora: LoraLaunch | None,
                  ) -> AsyncIterator[LaunchedEngine]:  # fmt: skip
    """`launch_engine` on `port`."""
    if lora is not None:
        extra_args = [*extra_args, *lora.args()]
    if api_key:
        extra_args = [*extra_args, "--api-key", api_key]
    if admin_api_key:
        extra_args = [*extra_args, "--admin-api-key", admin_api_key]
    model = os.path.abspath(model_path) if os.path.exists(model_path) else str(model_path)
    argv = build_command(kind, model, host, port, extra_args, command)
    guarded = kind == "sglang"  # a server without our parent watchdog: kill its group with us
    if guarded:
        argv = [sys.executable, "-m", "engines.orphan_guard", str(os.getpid()), "--", *argv]
    temp_log = log_path is None
    if temp_log:
        fd, name = tempfile.mkstemp(prefix=f"engine-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log = Path(log_path)
    url = f"http://{host}:{port}"
    child_env = {**os.environ, "ROLLOUTS_PARENT_PID": str(os.getpid()), **(env or {})}
    if (kind == "local" and not command) or guarded:  # `engines` importable wherever we run
        root = str(Path(__file__).resolve().parent.parent)
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
    logger.info("launching engine: %s (log: %s)", " ".join(argv), log)
    with log.open("ab") as log_file:
        run = partial(
            trio.run_process,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            check=False,
            env=child_env,
            cwd=None if cwd is None else str(cwd),
            # Its own session, so a terminal's Ctrl-C reaches only the trainer, which stops it
            # in order (a local engine also exits when its parent dies).
            start_new_session=True,
            deliver_cancel=partial(_terminate, timeout_s=terminate_timeout_s, group=guarded),
        )
        # The process stops when this block is left, not when the code around it is
        # cancelled: a cancelled run's shielded cleanup (resume the engines, abort requests,
        # checkpoint) still talks to the engine, which must outlive that cleanup.
        stop = trio.CancelScope(shield=True)

        async def run_until_stopped(task_status: trio.TaskStatus[trio.Process]) -> None:
            with stop:
                await run(task_status=task_status)

        # The process task itself never raises (check=False), so an error is the startup
        # failure or the caller's own, and `open_nursery` raises it as is.
        async with open_nursery() as nursery:
            process: trio.Process = await nursery.start(run_until_stopped)
            launched = LaunchedEngine(
                url=url, port=port, pid=process.pid, log_path=log, command=tuple(argv)
            )

            async def watch() -> None:
                await process.wait()
                launched.exited.set()

            nursery.start_soon(watch)
            try:
                await _wait_until_healthy(
                    process, url, log, startup_timeout_s, poll_interval_s, api_key
                )
                yield launched
            finally:
                stop.cancel()
                nursery.cancel_scope.cancel()
    logger.info("engine %s stopped (exit code %s)", url, process.returncode)
    if temp_log:  # nobody asked for it and all went well; after an error it stays, named there
        log.unlink(missing_ok=True)


async def _wait_until_healthy(
    process: trio.Process, url: str, log: Path, timeout_s: float, poll_s: float, api_key: str | None
) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = trio.current_time() + timeout_s
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10.0) as client:
        while True:
            if process.returncode is not None:
                raise EngineLaunchError(
                    f"engine process exited with code {process.returncode} before becoming "
                    f"healthy; log {log} ends with:\n{log_tail(log)}",
                    url=url,
                )
            try:
                response = await client.get("/health_generate")
                if response.status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if trio.current_time() > deadline:
                raise EngineLaunchError(
                    f"engine not healthy after {timeout_s} s; log {log} ends with:\n{log_tail(log)}",
                    url=url,
                )
            await trio.sleep(poll_s)
