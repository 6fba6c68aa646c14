"""A warm interpreter for tests that run a whole program to completion (`make test`'s process
start-up, issue 28).

Most of what a test's Python process costs on this machine is its imports: torch, transformers
and a model class take ~3 CPU s before the program's first line of its own (`python -X
importtime`; `make test-cpu` shows that the suite's CPU is ~80 % in the processes it starts).
`WarmPython` pays them once: a zygote process imports them, then for each program forks a child
that runs it as `python PROGRAM ARGS` would — its own process and session, its own cwd,
environment, argv, `sys.path[0]`, stdout and stderr, `__main__`, exit status and interpreter
exit (atexit handlers, thread joins). The program imports what it needs as always; a module the
zygote already imported is found in `sys.modules` instead of being loaded again.

What a warm child cannot show, and so what stays on a fresh interpreter: anything about start-up
itself (which modules a command loads: `test_help_and_config_errors_answer_without_loading_torch`),
environment variables read at import by a warm module (`OMP_NUM_THREADS`, `GOMP_SPINCOUNT`: the
zygote is started with the suite's), and programs a test signals or watches while they run (the
child is the zygote's, not the test's: only its exit status comes back).

Ranks too: `run_ranks` forks the processes of one standalone torchrun job at once, each with
torchrun's variables, for the tests of what ranks compute (gradients and shapes at world 2 and
3); the tests of launching them (resume across world sizes, exit, two nodes, a killed rank) keep
torchrun.

    with WarmPython() as warm:
        proc = warm.run(["snippet.py"], cwd=tmp, env=env, timeout=600)   # a CompletedProcess
        proc = warm.run_ranks(["tests/distributed_grads.py", ...], 2, cwd=tmp, timeout=300)
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What the zygote imports: torch, transformers and the model classes the tiny and test models
# use, and the project's heavy modules (each program still imports what it uses).
WARM_MODULES = (
    "plumbing.threads",
    "torch",
    "safetensors.torch",
    "transformers",
    "trio",
    "httpx",
    "training",
    "training.backend.pytorch",
    "training.recipes.cli",
)

_ZYGOTE = r"""
import json, os, signal, sys, importlib
sys.path[0] = ROOT
from plumbing.gc_pause import gc_paused
with gc_paused(freeze=True):  # the imports' objects: never walked here nor in a forked program
    for name in MODULES:
        importlib.import_module(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401
requests, replies = sys.stdin.buffer, sys.stdout.buffer

def reply(obj):
    replies.write((json.dumps(obj) + "\n").encode())
    replies.flush()

def serve():
    reply({"ready": os.getpid()})
    while True:
        line = requests.readline()
        if not line:
            os._exit(0)
        req = json.loads(line)
        running = set()
        for proc in req["procs"]:
            pid = os.fork()
            if pid == 0:
                return req, proc
            running.add(pid)

        def kill_all():
            for pid in running:
                for kill in (os.killpg, os.kill):  # os.kill: before the child's setsid
                    try:
                        kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

        timed_out = []

        def past_deadline(signum, frame):
            timed_out.append(True)
            kill_all()

        signal.signal(signal.SIGALRM, past_deadline)
        signal.setitimer(signal.ITIMER_REAL, req["timeout"])
        cpu_s, first_failure = 0.0, 0
        while running:
            pid, status, usage = os.wait4(-1, 0)  # retried after the alarm's handler (PEP 475)
            running.discard(pid)
            cpu_s += usage.ru_utime + usage.ru_stime
            code = os.waitstatus_to_exitcode(status)
            if code != 0 and not first_failure:
                first_failure = code
                kill_all()  # as torchrun does: one failed process ends the others
        signal.setitimer(signal.ITIMER_REAL, 0)
        reply({"returncode": first_failure, "timed_out": bool(timed_out), "cpu_s": cpu_s})


req, proc = serve()
# The child: from here on, the program as `python PROGRAM ARGS` would run it.
os.setsid()
os.chdir(req["cwd"])
os.environ.clear()
os.environ.update(proc["env"])
for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                        (1, proc["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                        (2, proc["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)
sys.stdin = open(0, closefd=False)
sys.stdout = open(1, "w", buffering=1, closefd=False)
sys.stderr = open(2, "w", buffering=1, closefd=False)
program = os.path.abspath(req["argv"][0])
sys.argv = [program, *req["argv"][1:]]
extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
sys.path[:1] = [os.path.dirname(program), *extra]  # as a fresh `python PROGRAM` would have it
signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the zygote's deadline handler is not the program's
del req, proc, requests, replies, extra, fd, path, flags, opened
import runpy
runpy.run_path(program, run_name="__main__")
"""


_children_cpu_s = 0.0
_shared: WarmPython | None = None


def children_cpu_s() -> float:
    """CPU seconds of every program this process's `WarmPython`s have run to completion (they
    are the zygote's children, so this process's RUSAGE_CHILDREN does not see them;
    tests/cpu_usage.py adds this)."""
    return _children_cpu_s


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class WarmPython:
    """A zygote process with the heavy modules imported; `run` forks a program from it."""

    def __init__(self, env: dict[str, str] | None = None):
        code = _ZYGOTE.replace("ROOT", repr(str(ROOT))).replace("MODULES", repr(WARM_MODULES))
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env or dict(os.environ))  # fmt: skip
        self._lock = threading.Lock()
        ready = self._read()
        assert "ready" in ready, ready

    def _read(self) -> dict:
        line = self._proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the warm interpreter exited ({self._proc.wait()})")
        return json.loads(line)

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str] | None = None,
            timeout: float) -> subprocess.CompletedProcess:  # fmt: skip
        """`python *argv` in `cwd` with `env` (default: this process's), to completion; past
        `timeout` its process group is killed and `subprocess.TimeoutExpired` raised."""
        return self._run(argv, [env or dict(os.environ)], cwd=cwd, timeout=timeout)

    def run_ranks(self, argv: list[str], world: int, *, cwd: Path,
                  env: dict[str, str] | None = None, timeout: float) -> subprocess.CompletedProcess:  # fmt: skip
        """`python *argv` as the `world` ranks of one standalone torchrun job would run it: one
        process per rank, each with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
        LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free loopback port). As torchrun does,
        a rank that fails ends the others; the returncode is the first to fail's (else 0)
        and stdout/stderr are the ranks' in rank order. For tests of what the ranks compute
        (gradients, shapes); tests of the launcher itself keep torchrun.

        The job's store is hosted here, as torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE:
        every rank is its client), on a port bound before any rank starts. A port found free and
        bound later by rank 0 could be taken meanwhile by another xdist worker's server."""
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
        base = env or dict(os.environ)
        envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                 "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
                for r in range(world)]  # fmt: skip
        try:
            return self._run(argv, envs, cwd=cwd, timeout=timeout)
        finally:
            del store  # its server closes with it, after every rank has ended

    def _run(self, argv: list[str], envs: list[dict[str, str]], *, cwd: Path,
             timeout: float) -> subprocess.CompletedProcess:  # fmt: skip
        """One process per entry of `envs`, all started at once and waited for together."""
        with self._lock, tempfile.TemporaryDirectory(prefix="warm_") as tmp:
            outs = [(Path(tmp, f"stdout{i}"), Path(tmp, f"stderr{i}")) for i in range(len(envs))]
            procs = [{"env": e, "stdout": str(o), "stderr": str(r)}
                     for e, (o, r) in zip(envs, outs, strict=True)]  # fmt: skip
            req = {"argv": [str(a) for a in argv], "cwd": str(cwd), "procs": procs,
                   "timeout": timeout}  # fmt: skip
            self._proc.stdin.write((json.dumps(req) + "\n").encode())  # type: ignore[union-attr]
            self._proc.stdin.flush()  # type: ignore[union-attr]
            result = self._read()
            global _children_cpu_s
            _children_cpu_s += result["cpu_s"]
            stdout = "".join(_text(o) for o, _ in outs)
            stderr = "".join(_text(r) for _, r in outs)
        if result["timed_out"]:
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
        return subprocess.CompletedProcess([sys.executable, *argv], result["returncode"],
                                           stdout, stderr)  # fmt: skip

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.send_signal(signal.SIGKILL)
                self._proc.wait()

    def __enter__(self) -> WarmPython:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shared() -> WarmPython:
    """This process's warm interpreter (a pytest worker's: started at first use, closed at
    exit), for tests and helpers that run a program to completion."""
    global _shared
    if _shared is None:
        import atexit

        _shared = WarmPython()
        atexit.register(_shared.close)
    return _shared


def run(argv: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:  # fmt: skip
    """`python *argv` to completion, forked from this process's warm interpreter: what
    `subprocess.run([sys.executable, *argv], capture_output=True, text=True)` gives, for a
    program that imports torch and transformers, ~3 CPU s sooner."""
    return shared().run([str(a) for a in argv], cwd=cwd, env=env, timeout=timeout)
