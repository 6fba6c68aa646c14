"""`benchmarks/controller_scale.py --quick` runs end to end (issue 31): a controller child, its
simulated fleet in a process of its own, a table and a RESULTS.md section in the ignored folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_controller_scale_quick_run_prints_the_curve_and_writes_its_section():
    proc = subprocess.run(
        [sys.executable, "benchmarks/controller_scale.py", "--quick", "--engines", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 2 ")]
    assert len(rows) == 1 and "8x4x64" in rows[0]
    section = (REPO / "benchmarks/results/quick/RESULTS.md").read_text()
    assert "<!-- begin controller_scale -->" in section and "CPU share" in section
