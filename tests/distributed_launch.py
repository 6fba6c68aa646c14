"""Launching scripts as `python script` (world 1, forked from the warm interpreter), under
torchrun (world ≥ 2), as ranks forked from the warm interpreter with torchrun's variables, or as
two torchrun nodes, for the FSDP2 tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engines import find_free_port

if TYPE_CHECKING:
    from tests.warm_python import WarmPython

ROOT = Path(__file__).parent.parent
# Every mode `tests/distributed_grads.py` runs; one launch per world size computes them all, and
# the full-model and LoRA tests read their own modes from the same runs.
GRAD_MODES = ("sft", "grpo-token-mean", "grpo-seq-mean", "sft-lora", "grpo-token-mean-lora",
              "sft-tied", "grpo-token-mean-tied")  # fmt: skip


class LaunchTimeout(AssertionError):
    """A launch ran past its deadline (a hang): it and every rank it started were killed."""


def launch(script: str, *args: str, world: int, cwd: Path, timeout: float = 300,
           warm: WarmPython | None = None):  # fmt: skip
    """Run `script` as `python script` (world 1) or under torchrun (world ≥ 2), one thread per
    rank.

    The launch has a deadline: past `timeout` seconds torchrun and every rank (which would
    otherwise outlive it) are killed and `LaunchTimeout` raised, with the output so far.

    World 1 is forked from this worker's warm interpreter (tests/warm_python.py: a process of
    its own, ~3 CPU s of imports sooner). `warm` forks the ranks of world ≥ 2 from it too, with
    torchrun's variables, for tests of what the ranks compute rather than of how they are
    launched; the deadline is the same.
    """
    if world == 1 and warm is None:
        from tests.warm_python import shared

        warm = shared()
    if warm is not None:
        return _launch_warm(warm, script, *args, world=world, cwd=cwd, timeout=timeout)
    prefix = [sys.executable]
    if world > 1:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*prefix, str(ROOT / script), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        raise LaunchTimeout(
            f"{script} at world {world} did not finish within {timeout:.0f} s (a hang?); "
            f"killed. stderr tail:\n{stderr[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _launch_warm(warm: WarmPython, script: str, *args: str, world: int, cwd: Path,
                 timeout: float) -> subprocess.CompletedProcess:  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [str(ROOT / script), *args]
    try:
        if world == 1:
            return warm.run(argv, cwd=cwd, env=env, timeout=timeout)
        return warm.run_ranks(argv, world, cwd=cwd, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise LaunchTimeout(
            f"{script} at world {world} did not finish within {timeout:.0f} s (a hang?); "
            f"killed. stderr tail:\n{(err.stderr or '')[-3000:]}"
        ) from None


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found in /proc, then theirs)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it: torchrun starts each rank in a session of its
    own, so killing torchrun's process group would leave the ranks hanging."""
    for victim in [*descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def gradient_runs(model_dir: Path, out: Path, warm: WarmPython | None = None) -> Path:
    """`distributed_grads.py` for every GRAD_MODES mode at world 1 and 2: out/w{1,2}/MODE/."""
    for world in (1, 2):
        proc = launch("tests/distributed_grads.py", str(model_dir), str(out / f"w{world}"),
                      ",".join(GRAD_MODES), world=world, cwd=out, warm=warm)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def launch_two_nodes(script: str, *args: str, cwd: Path, timeout: float = 300):
    """Run `script` as two torchrun "nodes" on this machine (one process each), joined by a
    c10d rendezvous on 127.0.0.1, the way two real nodes are launched (README: Two nodes).

    Node 0 hosts the rendezvous store (`is_host=1`; on real nodes the host whose address is the
    endpoint does so by itself). Which node's process becomes rank 0 is the rendezvous's choice.

    Returns:
        The two nodes' CompletedProcess, node 0 first.
    """
    port = find_free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", "1", "--node_rank", str(node), "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"two-nodes-{port}",
               "--rdzv_conf", f"is_host={int(node == 0)}", "--local_addr", "127.0.0.1",
               str(ROOT / script), *args]  # fmt: skip
        # Files, not pipes: a node blocked on a full pipe would stall the other in a collective.
        out, err = (open(cwd / f"node{node}-{port}.{kind}", "w+") for kind in ("out", "err"))  # noqa: SIM115
        logs.append((out, err))
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    done = []
    for proc, (out, err) in zip(procs, logs, strict=True):
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, *texts))
    return done
