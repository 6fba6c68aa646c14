"""`benchmarks/controller_scale.py --quick` runs end to end (issue 31): a controller child, its
simulated fleet in a process of its own, a table and a RESULTS.md section in the ignored folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_controller_scale_quick_run_prints_the_curve_and_writes_its_section():
    proc = subprocess.run(
        [sys.executable, "benchmarks/controller_scale.py", "--quick", "--engines", "2",
         "--workers", "0,1"],
        # ~14 CPU s with its child processes: 15 s of wall time at load 5 on 2 cores, 58 s
        # beside 4 more busy loops; the deadline only catches a hang
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in proc.stdout.splitlines()
            if ln.startswith("| 2 ")]  # fmt: skip
    assert [r[:3] for r in rows] == [["2", "0", "8x4x64"], ["2", "1", "8x4x64"]]
    # with a worker, its CPU per 1,000 response tokens is measured (from /proc), and positive
    assert rows[0][12] == "-" and float(rows[1][12]) > 0
    section = (REPO / "benchmarks/results/quick/RESULTS.md").read_text()
    assert "<!-- begin controller_scale -->" in section and "CPU share" in section
