"""`make test-cpu`'s accounting: a test's CPU includes the processes it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.cpu_usage import summary
from tests.distributed_launch import ROOT

BURN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"


def test_each_tests_row_counts_the_cpu_of_the_processes_it_started(tmp_path):
    (tmp_path / "test_burn.py").write_text(textwrap.dedent(f"""
        import subprocess, sys
        def test_child_burns():
            subprocess.run([sys.executable, "-c", "{BURN}"], check=True)
        def test_idle():
            pass
    """))  # fmt: skip
    rows_path = tmp_path / "cpu.jsonl"
    env = {**os.environ, "ROLLOUTS_TEST_CPU": str(rows_path), "PYTHONPATH": str(ROOT)}
    # the project's conftest (which records) is loaded through -p, as a plugin by module name
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest",
                           "-p", "no:cacheprovider", str(tmp_path / "test_burn.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {
        r["id"].rsplit("::", 1)[1]: r for r in map(json.loads, rows_path.read_text().splitlines())
    }
    assert rows["test_child_burns"]["children_s"] >= 0.45, rows
    assert rows["test_idle"]["children_s"] < 0.05, rows
    table = summary(rows_path)
    assert "test_burn.py" in table and table.startswith("2 tests: "), table
