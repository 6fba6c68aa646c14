"""Where `make test`'s CPU goes, per test and per file (`make test-cpu`).

Why CPU and not wall time: on the 2-core machine the suite is CPU-bound (three xdist workers keep
both cores busy), so its wall time is about its CPU seconds over 2, and most of those are spent
in the processes tests start (torchrun ranks, local engines, the CLI), which `--durations` does
not show. Each test's row is its worker's own CPU plus that of the child processes reaped during
it (`RUSAGE_CHILDREN`: a process counts once its parent has waited for it, which the launchers
here do), and that of the programs a warm interpreter forked for it (tests/warm_python.py; the
zygote's own imports, once per worker, are not in any row).

    ROLLOUTS_TEST_CPU=runs/test_cpu.jsonl pytest ...   # rows, one JSON object per test
    python -m tests.cpu_usage runs/test_cpu.jsonl        # the table, heaviest files first
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from pathlib import Path


def cpu_seconds() -> tuple[float, float]:
    """(this process, its reaped children): user + system seconds so far."""
    from tests.warm_python import children_cpu_s  # programs forked by a warm interpreter

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + children_cpu_s()


class CPURecorder:
    """A pytest plugin that appends one row per test to `path` (xdist workers share the file:
    each row is one short `write` in append mode)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def record(self, nodeid: str, before: tuple[float, float], wall_s: float) -> None:
        own, children = (after - b for after, b in zip(cpu_seconds(), before, strict=True))
        row = {"id": nodeid, "self_s": round(own, 3), "children_s": round(children, 3),
               "wall_s": round(wall_s, 3), "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
               "end": round(time.time(), 2)}  # fmt: skip
        with self.path.open("a") as out:
            out.write(json.dumps(row) + "\n")

    def around(self, nodeid: str):
        """Start measuring a test; call the returned function when it is done."""
        before, began = cpu_seconds(), time.monotonic()
        return lambda: self.record(nodeid, before, time.monotonic() - began)


def summary(path: str | Path, most: int = 30) -> str:
    """The table: CPU seconds by file (own, children, total), wall seconds, tests; then the
    heaviest single tests."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for row in rows:
        f = files[row["id"].split("::", 1)[0]]
        f[0] += row["self_s"]
        f[1] += row["children_s"]
        f[2] += row["wall_s"]
        f[3] += 1
    own = sum(f[0] for f in files.values())
    children = sum(f[1] for f in files.values())
    lines = [f"{len(rows)} tests: {own + children:.0f} CPU s ({own:.0f} in the pytest workers, "
             f"{children:.0f} in processes they started)", "",
             f"{'file':46} {'own':>6} {'child':>6} {'total':>6} {'wall':>6} {'tests':>5}"]  # fmt: skip
    ranked = sorted(files.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    for name, (o, c, w, n) in ranked[:most]:
        lines.append(f"{name:46} {o:6.0f} {c:6.0f} {o + c:6.0f} {w:6.0f} {n:5d}")
    lines += ["", "heaviest tests (CPU s, wall s):"]
    for row in sorted(rows, key=lambda r: -(r["self_s"] + r["children_s"]))[:most]:
        lines.append(f"{row['self_s'] + row['children_s']:6.1f} {row['wall_s']:6.1f} {row['id']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1] if len(sys.argv) > 1 else "runs/test_cpu.jsonl"))
