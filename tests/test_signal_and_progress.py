"""Signal, not silence (issue 27): flat RL steps are named, a run without signal warns once,
train_rl reports held-out accuracy, and every phase prints one line per step, bars off."""

import json
import logging
import re
import subprocess
import textwrap
from pathlib import Path

from tests import warm_python
from tests.rl_helpers import batch_of
from training.loops.progress import Eta, console_logging_if_unconfigured, format_duration
from training.recipes.quick import heldout_split
from training.recipes.rl_summary import RLSummary
from training.rl.signal import NoSignalWatch, signal_metrics, why_no_signal

ROOT = Path(__file__).parent.parent
STEP_LINE = re.compile(r"INFO rollouts: step (\d+)/(\d+) ")


def test_a_batch_whose_groups_all_have_equal_rewards_is_named_no_signal():
    assert signal_metrics(batch_of([[0.0, 0.0], [1.0, 1.0]])) == {
        "groups_equal_reward": 2.0, "no_signal": 1.0}  # fmt: skip
    assert signal_metrics(batch_of([[0.0, 0.0], [0.0, 1.0]])) == {
        "groups_equal_reward": 1.0, "no_signal": 0.0}  # fmt: skip


def test_why_no_signal_tells_never_succeeds_from_always_succeeds_from_agreeing_groups():
    assert "never succeeds" in why_no_signal([0.0, 0.0, 0.0])
    assert "start from an SFT checkpoint" in why_no_signal([0.0])
    assert "same reward 1" in why_no_signal([1.0, 1.0])
    assert "n_samples_per_prompt" in why_no_signal([0.0, 0.0, 1.0, 1.0])


def test_no_signal_warning_comes_once_per_stretch_after_patience_steps(caplog):
    caplog.set_level(logging.WARNING, logger="rollouts")
    watch = NoSignalWatch(patience=3)
    flat, varied = batch_of([[0.0, 0.0]]), batch_of([[0.0, 1.0]])
    for step, batch in enumerate([flat, flat, flat, flat, flat, varied, flat, flat, flat], 1):
        watch.observe(step, batch)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # at step 3, and again at step 9 after the signal at step 6
    assert warnings[0].startswith("no learning signal for 3 steps (to step 3")
    assert "never succeeds" in warnings[0]


def test_eta_is_the_mean_step_time_since_the_first_step_seen():
    now = [100.0]
    eta = Eta(800, clock=lambda: now[0])
    now[0] += 30.0  # set-up, then the first step of a run resumed at 400
    assert eta.describe(401) == "elapsed 0:30"  # set-up and one step: no rate yet
    now[0] += 20.0
    assert eta.describe(402) == "elapsed 0:50, ~2:12:40 left"  # 398 steps x 20 s
    now[0] += 40.0
    assert eta.describe(404) == "elapsed 1:30, ~2:12:00 left"  # 396 x (60 s / 3 steps)
    assert eta.describe(800) == "elapsed 1:30"
    assert format_duration(3725) == "1:02:05"


def test_a_time_capped_phase_estimates_the_time_left_before_its_cap():
    # continued SFT in the demo: 100,000 steps capped at RL's 120 s of wall time
    now = [0.0]
    eta = Eta(100_000, max_wall_s=120.0, clock=lambda: now[0])
    now[0] += 10.0
    eta.describe(1)
    now[0] += 1.0
    assert eta.describe(2) == "elapsed 0:11, ~1:49 left (time cap)"  # 120 - 11 s, not 27.8 h
    now[0] += 200.0  # past the cap (the step that crosses it is the last): nothing negative
    assert eta.describe(3) == "elapsed 3:31, ~0:00 left (time cap)"
    uncapped = Eta(10, max_wall_s=3600.0, clock=lambda: now[0])
    uncapped.describe(1)
    now[0] += 2.0
    assert uncapped.describe(2) == "elapsed 0:02, ~0:16 left"  # the steps end first: no note


def test_rl_summary_shows_the_partial_credit_reward_moving_while_accuracy_stays_at_zero():
    # issue 42: exact match 0 -> 0 while the held-out eval_reward_mean went 0.073 -> 0.10
    line = RLSummary(0.0, 0.0, 30, 61.0, None, (0.1,), reward_before=0.073,
                     reward_after=0.1).line()  # fmt: skip
    assert "heldout_accuracy before=0.0% after=0.0% (+0.0 points)" in line
    assert "heldout_reward_mean before=0.073 after=0.1 (+0.027)" in line


def test_rl_summary_without_held_out_prompts_says_what_to_set_instead_of_n_a():
    # issue 42's user: `data.train_path=` alone printed "heldout_accuracy before=n/a after=n/a"
    line = RLSummary(None, None, 6, 15.4, None, (0.01,)).line()
    assert line.startswith("RL done: heldout: not measured (no data.eval_path) steps=6"), line
    assert "n/a" not in line


def test_a_clean_evaluation_line_shows_its_scores_not_a_row_of_zero_failure_counters(caplog):
    from training.loops.loggers import ConsoleLogger

    clean = {"eval_accuracy": 0.25, "eval_reward_mean": 0.5, "eval_failed": 0, "eval_aborted": 0,
             "eval_abort_retries": 0, "eval_scored": 20, "eval_reward_failed": 0,
             "eval_reward_failure_rate": 0.0}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="rollouts"):
        ConsoleLogger(10, tty=False)(5, {"loss": 0.1, **clean})
        ConsoleLogger(10, tty=False)(5, {"loss": 0.1, **clean, "eval_aborted": 2})
    quiet, troubled = (r.getMessage() for r in caplog.records)
    assert "eval_accuracy=0.25 eval_reward_mean=0.5 [" in quiet, quiet
    assert "eval_aborted=2" in troubled and "eval_scored=20" in troubled, troubled
    assert "eval_failed" not in troubled  # still zero


def test_heldout_split_is_deterministic_a_tenth_capped_and_disjoint():
    records = [{"prompt": str(i)} for i in range(100)]
    train, held = heldout_split(records)
    assert (len(train), len(held)) == (90, 10) and heldout_split(records) == (train, held)
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    assert len(heldout_split([{"prompt": str(i)} for i in range(2000)])[1]) == 50
    assert heldout_split(records[:1]) == (records[:1], records[:1])


def test_console_handler_is_added_only_when_nothing_is_configured_and_removed_after():
    logger = logging.getLogger("rollouts")
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()  # pytest's capture handler would count as configured
    try:
        before = logger.handlers[:]
        with console_logging_if_unconfigured():
            assert len(logger.handlers) == len(before) + 1
        assert logger.handlers == before
        root.addHandler(logging.NullHandler())
        with console_logging_if_unconfigured():
            assert logger.handlers == before
    finally:
        root.handlers[:] = saved


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` as a program of its own with stdout and stderr piped (not a terminal), forked
    from the warm interpreter (tests/warm_python.py)."""
    program = cwd / "program.py"
    program.write_text(textwrap.dedent(code))
    return warm_python.run([program], cwd=cwd, timeout=600)


def step_lines(text: str) -> list[tuple[int, int]]:
    return [(int(m[1]), int(m[2])) for m in STEP_LINE.finditer(text)]


def test_train_rl_on_a_model_that_never_succeeds_warns_once_and_reports_heldout(
    tiny_model_dir, tmp_path
):
    """The README's one-call snippet, piped, with a reward the untrained model never earns."""
    proc = run_python(f"""
        from training import train_rl
        prompts = [{{"prompt": f"{{a}}+{{b}}", "answer": str(a + b)}} for a in range(5)
                   for b in range(4)]
        summary = train_rl({str(tiny_model_dir)!r}, prompts, lambda s: 0.0, max_steps=4,
                           output_dir={str(tmp_path / "run")!r},
                           overrides=["train.no_signal_steps=2", "rollout.batch_size=2",
                                      "rollout.n_samples_per_prompt=2",
                                      "rollout.sampling.max_new_tokens=4",
                                      "train.eval_max_new_tokens=4", "train.eval_every=100",
                                      "train.sample_every=3"])
        print(summary.line())
    """, tmp_path)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert step_lines(proc.stderr) == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert proc.stderr.count("NO SIGNAL (every group's rewards equal)") == 4
    warnings = [line for line in proc.stderr.splitlines() if "no learning signal" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "never succeeds" in warnings[0]
    assert "held out 2 of the 20 prompts given" in proc.stderr
    samples = re.findall(r"INFO rollouts\.rl: step (\d+) sample: prompt '.*' -> response '.*' "
                         r"\(\d+ tokens\) reward 0 .*its group's rewards: 0 0$", proc.stderr,
                         re.MULTILINE)  # fmt: skip
    assert samples == ["1", "3"], proc.stderr[-3000:]  # the first step, then every 3rd
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("RL done: heldout_accuracy before=0.0% after=0.0%"), summary
    assert "heldout_reward_mean before=0 after=0 (+0)" in summary, summary
    assert "n/a" not in summary
    assert "Writing model shards" not in out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["no_signal"] for r in rows] == [1.0] * 4


def test_sft_piped_prints_one_line_per_step_with_eta_and_no_save_bars(tiny_model_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{i}+1", "completion": str(i + 1)} for i in range(40)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = warm_python.run(
        [ROOT / "examples" / "run_sft.py",
         "--config", ROOT / "configs" / "sft_tiny.yaml", "--data", data,
         "--model", tiny_model_dir, "--output-dir", tmp_path / "out",
         "--max-steps", "4", "train.batch_size=8", "train.checkpoint_every=1"],
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_lines(proc.stderr) == [(1, 4), (2, 4), (3, 4), (4, 4)]
    second = [line for line in proc.stderr.splitlines() if STEP_LINE.search(line)][1]
    assert re.search(r"\[elapsed \d+:\d\d, ~\d+:\d\d left\]$", second), second
    assert "Writing model shards" not in proc.stdout + proc.stderr
