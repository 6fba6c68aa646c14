"""Run model-written Python in a subprocess with limits, without blocking the trio event loop.

Each run is a fresh `python -I -S -B -u` process (isolated mode: no site-packages, no user
site, no PYTHON* environment variables, no script directory on sys.path) in a new session,
with a fresh temporary working directory, a minimal environment and stdin from /dev/null. A
small prelude, run by the child before the snippet, applies the limits; the snippet's output
(stdout and stderr merged, in order) is read as it comes.

What is covered:
- Wall-clock timeout, output overflow and cancellation from outside: the whole process group
  is SIGKILLed and the process reaped before the call returns; the working directory is then
  deleted (in a worker thread, so a snippet that wrote many files cannot stall the loop).
- Resource limits (`resource.setrlimit`, set before the snippet runs; the hard limits cannot be
  raised again): address space (RLIMIT_AS), CPU seconds (RLIMIT_CPU), size of any written
  file (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core dumps, and no new processes
  (RLIMIT_NPROC = 0; the kernel does not apply this one to root, see below).
- Output: at most `max_output_bytes` is kept; a process that writes more is killed and the
  call fails ("output limit exceeded").
- Network: the child moves itself into a new, empty network namespace (`unshare`, as root or
  through a user namespace) where no interface is up, not even the host's loopback. If the
  kernel refuses, the run continues with only the audit hook below, unless
  `require_network_isolation` is set (then it fails).
- An audit hook (PEP 578) refuses socket creation, process creation (`os.system`,
  `subprocess`, `fork`, `exec*`, `posix_spawn`), signals to other processes (`os.kill`) and
  `ctypes`, so the usual escapes fail with a visible PermissionError.
- `user`/`group`: run the child as another (unprivileged) user; then file permissions and
  RLIMIT_NPROC apply. Needs root, and an interpreter that user can execute.

What is not covered:
- The audit hook is not a security boundary (PEP 578 says so): native extensions and
  interpreter tricks can get around it. The filesystem is not isolated: the snippet can read
  (and, running as the same user, write) whatever that user can. Memory and CPU limits are
  per process. A child that survives a parent exiting normally is not hunted down (forks are
  refused by RLIMIT_NPROC and the audit hook, not by this code). For untrusted code at scale, run this inside a container/VM (gVisor,
  Firecracker, nsjail) and set `user` to an unprivileged account.
- preexec_fn is deliberately not used: it is unsafe when the parent has threads (trio's
  worker threads), so the limits are applied by the child's prelude instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from rollouts.tools.base import Tool, ToolError, ToolResult

NETWORK_ISOLATION_FAILED = 97  # the prelude's exit code when isolation is required but refused

_PRELUDE = r"""
import json, resource, sys
_cfg = json.loads(sys.argv[1])
def _isolate_network():
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        # CLONE_NEWNET; then CLONE_NEWUSER | CLONE_NEWNET for an unprivileged user
        return any(libc.unshare(flags) == 0 for flags in (0x40000000, 0x50000000))
    except Exception:
        return False
    finally:
        for _m in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
            del sys.modules[_m]
if _cfg["isolate_network"] and not _isolate_network() and _cfg["require_network_isolation"]:
    sys.stderr.write("sandbox: the kernel refused a new network namespace (unshare)\n")
    sys.exit(97)
for _name, _soft, _hard in _cfg["rlimits"]:
    resource.setrlimit(getattr(resource, _name), (_soft, _hard))
def _audit(event, args):
    # Literal constants only: user code cannot reach into this function's state.
    if event in ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                 "os.forkpty", "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn",
                 "os.setuid", "os.chroot") or event.startswith(("socket.", "ctypes.")):
        raise PermissionError("sandbox: " + event + " is not allowed here")
    if event == "object.__setattr__" and args[1] in ("__code__", "__globals__"):
        raise PermissionError("sandbox: replacing function code is not allowed here")
sys.addaudithook(_audit)
with open("snippet.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "snippet.py", "exec")
del _cfg, _isolate_network, _f, _name, _soft, _hard
try:
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _exc:
    import traceback
    traceback.print_exception(type(_exc), _exc, _exc.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (see the module docstring for what each covers)."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    max_output_bytes: int = 16 * 1024
    max_file_bytes: int = 16 * 2**20
    max_open_files: int = 64
    max_code_chars: int = 100_000
    isolate_network: bool = True
    require_network_isolation: bool = False
    python: str = sys.executable
    user: int | str | None = None
    group: int | str | None = None

    def rlimits(self) -> list[tuple[str, int, int]]:
        return [
            ("RLIMIT_AS", self.memory_bytes, self.memory_bytes),
            ("RLIMIT_CPU", self.cpu_s, self.cpu_s + 1),  # SIGXCPU, then SIGKILL a second later
            ("RLIMIT_FSIZE", self.max_file_bytes, self.max_file_bytes),
            ("RLIMIT_NOFILE", self.max_open_files, self.max_open_files),
            ("RLIMIT_CORE", 0, 0),
            ("RLIMIT_NPROC", 0, 0),
        ]


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended. `exit_code` < 0: killed by that signal (SIGXCPU: CPU limit)."""

    output: str
    exit_code: int | None
    timed_out: bool = False
    output_limited: bool = False

    @property
    def success(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_limited

    def failure(self, limits: SandboxLimits) -> str | None:
        """Why the run failed, in words for the model; None when it succeeded."""
        if self.timed_out:
            return f"timed out after {limits.timeout_s} s (the process was killed)"
        if self.output_limited:
            return f"output limit exceeded: more than {limits.max_output_bytes} bytes (the process was killed)"
        if self.exit_code == NETWORK_ISOLATION_FAILED:
            return "the sandbox could not isolate the network"
        if self.exit_code is not None and self.exit_code < 0:
            number = -self.exit_code
            why = " (CPU time limit)" if number == signal.SIGXCPU else ""
            try:
                name = signal.Signals(number).name
            except ValueError:  # a real-time signal has no name
                name = f"signal {number}"
            return f"killed by {name}{why}"
        if self.exit_code:
            return f"exit code {self.exit_code}"
        return None


def _kill_group(process: trio.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(process.pid, signal.SIGKILL)


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in a fresh limited subprocess; return its output and how it ended.

    Raises:
        ToolError: the code is too long or not a string (nothing was run).
    """
    if not isinstance(code, str):
        raise ToolError(f"code must be a string, got {type(code).__name__}")
    if len(code) > limits.max_code_chars:
        raise ToolError(f"code is {len(code)} characters; the limit is {limits.max_code_chars}")
    config = {
        "isolate_network": limits.isolate_network,
        "require_network_isolation": limits.require_network_isolation,
        "rlimits": limits.rlimits(),
    }
    workdir = tempfile.mkdtemp(prefix="rollouts-sandbox-")
    try:
        return await _run_in(workdir, code, json.dumps(config), limits)
    finally:  # in a thread: a snippet that wrote many files must not stall the event loop
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(partial(shutil.rmtree, workdir, ignore_errors=True))


async def _run_in(workdir: str, code: str, config: str, limits: SandboxLimits) -> SandboxResult:
    path = os.path.join(workdir, "snippet.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(code)
    if limits.user is not None:
        _give_to(workdir, path, limits)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "HOME": workdir, "TMPDIR": workdir, "OMP_NUM_THREADS": "1"}  # fmt: skip
    process = await trio.lowlevel.open_process(
        [limits.python, "-I", "-S", "-B", "-u", "-c", _PRELUDE, config],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=workdir,
        env=env,
        start_new_session=True,  # own process group, so killpg reaches any child
        user=limits.user,
        group=limits.group,
        extra_groups=[] if limits.user is not None else None,
    )
    output = bytearray()
    limited = False
    try:
        with trio.move_on_after(limits.timeout_s) as scope:
            assert process.stdout is not None
            async with process.stdout:
                while chunk := await process.stdout.receive_some(65536):
                    output += chunk
                    if len(output) > limits.max_output_bytes:
                        limited = True
                        _kill_group(process)
                        break
            await process.wait()
    finally:
        if process.returncode is None:  # timed out, or cancelled from outside
            _kill_group(process)
        with trio.CancelScope(shield=True):
            await process.wait()
    text = bytes(output[: limits.max_output_bytes]).decode("utf-8", errors="replace")
    timed_out = scope.cancelled_caught and not limited
    return SandboxResult(text, None if timed_out else process.returncode, timed_out, limited)


def _give_to(workdir: str, path: str, limits: SandboxLimits) -> None:
    """Hand the work directory to the sandbox user (we are root when `user` is set)."""
    import grp
    import pwd

    user = limits.user
    uid = user if isinstance(user, int) else pwd.getpwnam(str(user)).pw_uid
    group = limits.group
    if group is None:
        gid = pwd.getpwuid(uid).pw_gid
    else:
        gid = group if isinstance(group, int) else grp.getgrnam(group).gr_gid
    os.chown(workdir, uid, gid)
    os.chown(path, uid, gid)


def make_python_executor(limits: SandboxLimits = SandboxLimits()):
    """An executor for `{"code": "..."}`: the run's output; failed unless it exited with 0."""

    async def python(arguments: Mapping[str, Any]) -> ToolResult:
        result = await run_python(arguments.get("code"), limits)
        return ToolResult(result.output, result.success, result.failure(limits))

    return python


def python_tool(limits: SandboxLimits = SandboxLimits(), *, name: str = "python") -> Tool:
    """The sandboxed Python executor as a `Tool` (one string argument, `code`)."""
    return Tool(
        name=name,
        description="Run Python 3 code (standard library only, no network); returns what it prints.",
        parameters={
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "a Python program; print the result"}
            },
            "required": ["code"],
        },
        executor=make_python_executor(limits),
        timeout_s=limits.timeout_s + 5.0,  # the sandbox's own timeout fires first
    )
