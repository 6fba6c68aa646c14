"""`python -m engines.orphan_guard PARENT_PID -- CMD ...`: run CMD, and kill it when PARENT dies.

`launch_engine` wraps servers it cannot change (SGLang) in this guard, so a SIGKILLed trainer
leaves no engine behind. The guard is started as the leader of a new process group; CMD and
everything it starts (SGLang's scheduler and detokenizer processes) stay in that group. The
guard polls its parent every 0.5 s and, once the parent is gone, SIGKILLs the whole group.
SIGTERM and SIGINT are passed on to CMD; the guard exits with CMD's exit code. CMD sees
`ROLLOUTS_PARENT_PID` set to the guard's pid (the local engine's own watchdog reads it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: python -m engines.orphan_guard PARENT_PID -- CMD ...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    env = {**os.environ, "ROLLOUTS_PARENT_PID": str(os.getpid())}
    child = subprocess.Popen(argv[2:], env=env)

    def forward(signum: int, frame: object) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:
            print(f"orphan_guard: parent {parent} is gone; killing {argv[2]}", file=sys.stderr)
            os.killpg(0, signal.SIGKILL)  # the group: CMD, its children and this guard


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
