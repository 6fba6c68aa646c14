"""examples/demo.py: SFT, then RL and continued SFT from the same checkpoint, one verdict."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm_python
from training.backend.checkpoint import checkpoint_step, find_latest_checkpoint

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from demo import DemoResult, arm_curve  # noqa: E402


def result(rl: float, continued: float, last=(0.58, 0.585, 0.58, 0.59, 0.58), **kw):
    steps = tuple(range(1600, 2001, 100))
    fields = dict(sft_checkpoint="ckpt", sft_accuracy=last[-1], sft_last_evals=last,
                  sft_last_steps=steps, sft_wall_s=300.0, rl_before=0.58,
                  rl_accuracy=rl, rl_steps=300, rl_wall_s=120.0, continued_accuracy=continued,
                  continued_steps=1000, continued_wall_s=150.0)  # fmt: skip
    return DemoResult(**{**fields, **kw})


def test_verdict_says_when_rl_did_not_beat_continued_sft():
    assert "RL beat continued SFT by 20.0 points" in result(0.79, 0.59).verdict()
    assert "RL did NOT beat continued SFT (-1.0 points)" in result(0.58, 0.59).verdict()
    assert "RL did NOT beat" in result(0.59, 0.59).verdict()


def test_verdict_flags_an_sft_curve_still_moving_and_a_short_baseline():
    assert "(flat), spread 1.0" in result(0.8, 0.6).verdict()
    climbing = result(0.8, 0.6, last=(0.15, 0.3, 0.45, 0.56, 0.81))
    assert "drift +63.2 points (NOT flat)" in climbing.verdict()
    jitter = result(0.8, 0.6, last=(0.608, 0.592, 0.588, 0.618, 0.578))  # measured, p=0.8
    assert "(flat), spread 4.0" in jitter.verdict()
    assert "mean 59.7%" in jitter.verdict()
    assert "raise --continued-steps" in result(0.8, 0.6, continued_wall_s=100.0).verdict()
    assert "raise --continued-steps" not in result(0.8, 0.6).verdict()


def test_rl_gain_is_measured_against_the_plateau_mean():
    assert (
        "RL gain over the plateau mean: +21.7 points (met: target +15)"
        in result(0.8, 0.6).verdict()
    )
    assert "+12.7 points (MISSED" in result(0.71, 0.6).verdict()


def test_table_gives_each_arm_its_gain_over_sft():
    lines = result(0.79, 0.59).table().splitlines()
    assert "+21.0" in lines[2] and "+1.0" in lines[3] and "1000" in lines[3]


def wait_for_rows(path: Path, n: int, proc: subprocess.Popen, deadline_s: float = 300) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{path} did not reach {n} rows within {deadline_s} s")


@pytest.mark.slow
def test_demo_stopped_by_sigterm_mid_rl_resumes_from_its_checkpoints(tiny_model_dir, tmp_path):
    """Issue 42: a stopped `make demo` started over, and SIGTERM printed nothing."""
    out = tmp_path / "demo"
    (out / "rl").mkdir(parents=True)
    (out / "rl" / "stale.txt").write_text("from an earlier run")
    data = [f"data.task_dir={tmp_path / 'data'}", "data.arithmetic.n_sft=200",
            "data.arithmetic.n_rl=64", "data.arithmetic.n_eval=16"]  # fmt: skip
    sft = [*data, f"model.path={tiny_model_dir}", "train.max_steps=4", "train.eval_every=2",
           "train.greedy_eval_samples=8", "train.eval_samples=8", "backend.num_threads=1"]  # fmt: skip
    rl = [*data, "train.max_steps=8", "train.eval_every=4", "train.eval_samples=8",
          "train.checkpoint_every=1", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
          "rollout.filter_groups=none"]  # fmt: skip
    args = ["--out", str(out), "--continued-steps", "2"]
    args += [a for kv in sft for a in ("--sft", kv)] + [a for kv in rl for a in ("--rl", kv)]
    demo = str(ROOT / "examples" / "demo.py")
    # a process of its own (a warm child cannot be signalled), stopped as `kill` stops it
    first = subprocess.Popen([sys.executable, demo, "--fresh", *args], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)  # fmt: skip
    wait_for_rows(out / "rl" / "metrics.jsonl", 2, first)
    os.killpg(first.pid, signal.SIGTERM)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 130, stderr[-3000:]
    assert not (out / "rl" / "stale.txt").exists()  # --fresh cleared the earlier demo
    assert "Traceback" not in stderr
    kept = checkpoint_step(find_latest_checkpoint(out / "rl" / "checkpoints"))
    resume = f"make demo DEMO_ARGS={shlex.quote(shlex.join(args))}"
    assert re.fullmatch(rf"stopped by SIGTERM during RL after step (\d+); last checkpoint: "
                        rf"{out}/rl/checkpoints/step_0*{kept}; resume with `{re.escape(resume)}`",
                        stderr.strip().splitlines()[-1]), stderr[-2000:]  # fmt: skip
    assert 2 <= kept < 8

    proc = warm_python.run([demo, *args], cwd=ROOT, timeout=600)  # what `make demo` runs again
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"SFT: finished in an earlier run ({out / 'sft'}): skipped. SFT done:" in proc.stdout
    assert re.search(rf"RL: resuming from {out}/rl/checkpoints/step_0*{kept} \(step {kept}\)",
                     proc.stdout)  # fmt: skip
    rl_lines = [int(m[1]) for m in re.finditer(r"rollouts: step (\d+)/8 ", proc.stderr)]
    assert rl_lines == list(range(kept + 1, 9))  # the step numbers continue
    assert " step 1/4 " not in proc.stderr  # SFT did not run again
    rows = [json.loads(x)["step"] for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 9))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 8 and summary["continued_steps"] == 2
    assert summary["sft_last_steps"] == [2, 4]  # its evals
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("RL beat continued SFT") or "did NOT beat" in lines[-1]
    assert lines[-2].startswith("RL gain over the plateau mean")
    assert lines[-3].startswith("SFT plateau: last")
    # RL's wall time and clock count the first run's seconds up to its checkpoint, too
    clock = dict(summary["rl_clock"])
    assert sorted(clock) == list(range(1, 9)) and clock[kept] < clock[kept + 1]
    for arm in ("rl", "continued"):  # the plotted arm ends where the table's wall time does
        (*_, (last_step, last_s)) = summary[f"{arm}_clock"]
        assert last_step == summary[f"{arm}_steps"]
        assert summary[f"{arm}_wall_s"] - 5 < last_s <= summary[f"{arm}_wall_s"], summary


def test_demo_says_up_front_what_it_runs_and_how_long_at_this_load():
    from demo import plan

    quiet = plan(3000, 200, load=0.5, cores=2)
    assert "SFT on an imperfect teacher, 3000 steps (~6 min)" in quiet
    assert "RL, 200 steps (~3 min)" in quiet and "that is ~11 min" in quiet
    assert "grows with the machine's load" in quiet and "expect at least ~11 min" in quiet
    assert "expect at least ~33 min" in plan(3000, 200, load=6.0, cores=2)  # load 6 on 2 cores: 3x
    assert "SFT skipped (--start)" in plan(None, 200, load=0.0, cores=2)


def test_an_arm_is_plotted_in_percent_from_zero_seconds_to_its_last_logged_eval():
    rows = [{"step": 1}, {"step": 2, "accuracy": 0.6}, {"step": 3}, {"step": 4, "accuracy": 0.7}]
    clock = [(1, 12.0), (2, 15.5), (3, 16.0), (4, 21.25)]
    assert arm_curve(rows, "accuracy", clock, start=0.5) == ([0.0, 15.5, 21.25], [50.0, 60.0, 70.0])
