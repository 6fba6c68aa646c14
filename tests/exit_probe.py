"""Run a script as `__main__` and, when the interpreter starts to finalize, print the gloo
threads still alive in this process (`exit probe: rank R gloo threads [...]`).

    python -m torch.distributed.run ... tests/exit_probe.py SCRIPT [ARGS ...]

An atexit handler runs at the start of finalization: a gloo thread alive then can still meet a
finalizing interpreter and abort the process (training/distributed/teardown.py). A rank that
ends with os._exit prints nothing: `tests/test_torchrun_exit.py` counts that as a failure too.
"""

import atexit
import os
import runpy
import sys


def gloo_threads() -> list[str]:
    """Self-contained (not training.distributed.teardown's), so that it probes older checkouts."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return sorted(n for n in names if n.startswith(("pt_gloo_runloop", "gloo_tcp_loop")))


def report() -> None:
    # one write: the ranks share stderr, and print() may split a line between two writes
    line = f"exit probe: rank {os.environ.get('RANK', '0')} gloo threads {gloo_threads()}\n"
    os.write(2, line.encode())


if __name__ == "__main__":
    atexit.register(report)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
