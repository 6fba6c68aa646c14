"""tests/warm_python.py: a program forked from the warm interpreter runs as `python PROGRAM ARGS`
would — what the docs and CLI tests that use it rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

PROBE = """
import atexit, json, os, sys, threading
print("to stdout")
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: print("thread joined", flush=True)).start()
json.dump({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
           "env": os.environ.get("PROBE_VALUE"), "sid": os.getsid(0) == os.getpid(),
           "stdin": sys.stdin.read()}, open("probe.json", "w"))
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_program_sees_its_own_argv_cwd_env_and_exit_status(warm_python, tmp_path):
    program = tmp_path / "sub" / "probe.py"
    program.parent.mkdir()
    program.write_text(PROBE)
    env = {**os.environ, "PROBE_VALUE": "x"}
    proc = warm_python.run([program, "3", "--flag"], cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["to stdout", "thread joined", "atexit ran"]
    assert proc.stderr == "to stderr\n"
    seen = json.loads((tmp_path / "probe.json").read_text())
    assert seen == {"name": "__main__", "argv": [str(program), "3", "--flag"],
                    "cwd": str(tmp_path), "path0": str(program.parent), "env": "x",
                    "sid": True, "stdin": ""}  # fmt: skip
    # the same as a fresh interpreter gives
    fresh = subprocess.run([sys.executable, str(program), "3", "--flag"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)  # fmt: skip
    assert (fresh.returncode, fresh.stdout, fresh.stderr) == (3, proc.stdout, proc.stderr)


def test_an_uncaught_exception_exits_1_with_its_traceback(warm_python, tmp_path):
    program = tmp_path / "boom.py"
    program.write_text("raise ValueError('boom')\n")
    proc = warm_python.run([program], cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ValueError: boom" in proc.stderr


def test_a_program_past_its_deadline_is_killed_with_its_children(warm_python, tmp_path):
    program = tmp_path / "hang.py"
    program.write_text("import subprocess, sys, time\n"
                       "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                       "open('child.pid', 'w').write(str(child.pid))\n"
                       "time.sleep(60)\n")  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([program], cwd=tmp_path, timeout=2)
    assert time.monotonic() - t0 < 20
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(100):  # its process group was killed: the grandchild is gone too
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the program's child {child} outlived the deadline")
    # and the warm interpreter serves the next program
    ok = tmp_path / "ok.py"
    ok.write_text("print('next')\n")
    assert warm_python.run([ok], cwd=tmp_path, timeout=60).stdout == "next\n"


RANK_PROBE = """
import os
import torch
import torch.distributed as dist
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"])
dist.init_process_group("gloo")  # the env:// rendezvous that torchrun's variables describe
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print("sum", int(t.item()))
dist.destroy_process_group()
"""


def test_ranks_forked_together_form_one_gloo_job(warm_python, tmp_path):
    """run_ranks gives each rank torchrun's variables: three ranks rendezvous and all-reduce."""
    program = tmp_path / "ranks.py"
    program.write_text(RANK_PROBE)
    proc = warm_python.run_ranks([program], 3, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == ["rank 0 of 3 0", "sum 6", "rank 1 of 3 1", "sum 6", "rank 2 of 3 2", "sum 6"]


def test_ranks_find_their_master_port_already_held_before_any_of_them_starts(warm_python, tmp_path):
    """The job's store is bound before the ranks are forked (as torchrun's agent binds it), so
    no other process can take MASTER_PORT while rank 0 is still setting up: there is no
    window in which it is free."""
    program = tmp_path / "port.py"
    program.write_text("import os, socket\n"
                       "with socket.socket() as sock:\n"
                       "    try:\n"
                       "        sock.bind(('127.0.0.1', int(os.environ['MASTER_PORT'])))\n"
                       "        print('free')\n"
                       "    except OSError:\n"
                       "        print('held')\n")  # fmt: skip
    proc = warm_python.run_ranks([program], 2, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["held", "held"]


def test_a_failed_rank_ends_the_others_as_torchrun_does(warm_python, tmp_path):
    """Rank 1 exits 3 while rank 0 would wait 60 s (in a collective, say): the job ends at
    once with rank 1's status, as torchrun ends a job one of whose workers failed."""
    program = tmp_path / "fail.py"
    program.write_text("import os, sys, time\n"
                       "if os.environ['RANK'] == '1':\n"
                       "    sys.exit(3)\n"
                       "time.sleep(60)\n")  # fmt: skip
    t0 = time.monotonic()
    proc = warm_python.run_ranks([program], 2, cwd=tmp_path, timeout=120)
    assert proc.returncode == 3
    assert time.monotonic() - t0 < 20


def test_ranks_that_hang_are_all_killed_at_the_deadline(warm_python, tmp_path):
    """A deadlocked job (issue 24's shape before its fix): every rank is killed at the deadline
    and the test hears TimeoutExpired, not gloo's own 30-minute timeout."""
    program = tmp_path / "hang.py"
    program.write_text("import os, time\n"
                       "open(f\"rank{os.environ['RANK']}.pid\", 'w').write(str(os.getpid()))\n"
                       "time.sleep(60)\n")  # fmt: skip
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run_ranks([program], 2, cwd=tmp_path, timeout=3)
    for rank in (0, 1):
        pid = int((tmp_path / f"rank{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
