"""The command line as a person meets it: one `error:` line per cause, exit 2; a clean stop on
Ctrl-C/SIGTERM that says how to resume; no run mixed into an earlier one; the `rollouts` script."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines import find_free_port
from rollouts.errors import DataError, EngineError
from tests import warm_python
from tests.test_embed_example import engine_processes_for
from training.recipes.cli_run import EXIT_INTERRUPTED, print_errors, run_command

ROOT = Path(__file__).parent.parent
ROLLOUTS = Path(sys.executable).with_name("rollouts")


def rollouts(*args: str, cwd: Path, fresh: bool = False) -> subprocess.CompletedProcess:
    """The `rollouts` script with `args`, to completion: forked from the warm interpreter
    (tests/warm_python.py), or as its own fresh process when `fresh` (what the installed
    script itself does on start-up is the test)."""
    if not fresh:
        return warm_python.run([ROLLOUTS, *args], cwd=cwd, timeout=300)
    return subprocess.run([str(ROLLOUTS), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def assert_error_only(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, stderr's error lines name every needle, and no traceback or exception group."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ExceptionGroup" not in proc.stderr
    for needle in needles:
        assert any(needle in line for line in errors), (needle, errors)
    return "\n".join(errors)


def sft_args(model: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["sft", "--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--model", str(model),
            "--output-dir", str(tmp_path / "out"), *extra]  # fmt: skip


@pytest.fixture
def own_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model that only this test serves: the tests below find the engines
    they launched by its path, and other tests running beside them (xdist) serve the shared one."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def write_chats(path: Path, n: int, long_every: int = 0) -> Path:
    rows = []
    for i in range(n):
        answer = "9" * 200 if long_every and i % long_every == 0 else str(i + 1)
        rows.append({"prompt": f"{i}+1", "completion": answer})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_nested_exception_groups_print_each_cause_once(capsys):
    group = ExceptionGroup("outer", [ExceptionGroup("inner", [DataError("a.jsonl:3: bad")]),
                                     DataError("a.jsonl:3: bad"), EngineError("down")])  # fmt: skip
    assert print_errors(group)
    assert capsys.readouterr().err.splitlines() == ["error: a.jsonl:3: bad", "error: down"]
    assert not print_errors(ExceptionGroup("bug", [KeyError("x")]))  # a bug keeps its traceback


def test_a_second_ctrl_c_inside_a_nursery_is_still_a_clean_stop(tmp_path, capsys):
    # The second SIGINT raises KeyboardInterrupt wherever the first one's cleanup is running,
    # often inside a nursery: it reaches run_command wrapped in an exception group.
    from training.config import SFTRunConfig, load_config

    config = load_config(SFTRunConfig, str(ROOT / "configs/sft_tiny.yaml"),
                         [f"output_dir={tmp_path / 'run'}"])  # fmt: skip

    async def recipe(progress):
        raise BaseExceptionGroup("cleanup", [KeyboardInterrupt()])

    code, result = run_command(["--config", "x.yaml"], config, recipe, overwrite=False,
                               prog="rollouts sft")  # fmt: skip
    assert (code, result) == (EXIT_INTERRUPTED, None)
    err = capsys.readouterr().err
    assert "stopped by SIGINT" in err and "rollouts sft --config x.yaml --resume" in err
    assert "Traceback" not in err


def test_missing_data_file_is_named_before_the_model_loads(tmp_path, tiny_model_dir):
    proc = rollouts(*sft_args(tiny_model_dir, tmp_path, "--data", "nope.jsonl"), cwd=tmp_path)
    assert_error_only(proc, "data.train_path (--data): nope.jsonl: no such file")
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_bad_model_path_says_no_such_directory_not_a_hub_error(tmp_path):
    proc = rollouts("sft", "--model", str(tmp_path / "no_model"), "--data",
                    str(write_chats(tmp_path / "d.jsonl", 4)), cwd=tmp_path)  # fmt: skip
    text = assert_error_only(proc, "no_model: no such directory")
    assert "Repo id" not in text


def test_dead_engine_url_fails_once_without_retries(tmp_path, tiny_model_dir):
    url = f"http://127.0.0.1:{find_free_port('127.0.0.1')}"
    proc = rollouts("rl", "--config", str(ROOT / "configs" / "rl_tiny.yaml"), "--engine-url", url,
                    "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "out"),
                    f"data.task_dir={tmp_path / 'data'}", cwd=tmp_path)  # fmt: skip
    text = assert_error_only(proc, f"no engine answers at --engine-url ({url}")
    assert len(text.splitlines()) == 1
    assert "retry" not in proc.stderr  # said once, not after a round of retries


def test_pack_length_shorter_than_max_seq_len_names_the_config_keys(tmp_path, tiny_model_dir):
    data = write_chats(tmp_path / "long.jsonl", 8, long_every=1)
    proc = rollouts(*sft_args(tiny_model_dir, tmp_path, "--data", str(data), "--max-steps", "1",
                              "data.max_seq_len=128", "data.pack_length=64"), cwd=tmp_path)  # fmt: skip
    text = assert_error_only(proc, "data.pack_length=64", "data.max_seq_len=128")
    assert "max_tokens_per_row" not in text


def test_truncated_samples_are_named_with_the_key_that_raises_the_limit(tmp_path, tiny_model_dir):
    data = write_chats(tmp_path / "mine.jsonl", 20, long_every=2)  # lines 1, 3, 5, ... are long
    proc = rollouts(*sft_args(tiny_model_dir, tmp_path, "--data", str(data), "--max-steps", "1",
                              "data.max_seq_len=64", "train.batch_size=4"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    [warning] = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert "10 of 20 records were cut or dropped" in warning and "limit 64: cut by" in warning
    assert f"{data}:1 (tokens" in warning and f"; {data}:3 (tokens" in warning
    assert "and 5 more" in warning and "raise data.max_seq_len" in warning
    report = [
        json.loads(r) for r in (tmp_path / "out" / "data_report.jsonl").read_text().splitlines()
    ]
    assert [r["source"] for r in report] == [f"{data}:{k}" for k in range(1, 20, 2)]


def test_a_fresh_run_into_an_earlier_runs_directory_is_refused(tmp_path, tiny_model_dir):
    data = str(write_chats(tmp_path / "d.jsonl", 16))
    first = rollouts(*sft_args(tiny_model_dir, tmp_path, "--data", data, "--max-steps", "3",
                               "train.batch_size=4"), cwd=tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    again = sft_args(tiny_model_dir, tmp_path, "--data", data, "--max-steps", "2",
                     "train.batch_size=4")  # fmt: skip
    assert_error_only(rollouts(*again, cwd=tmp_path), "--resume", "--overwrite")
    fresh = rollouts(*again, "--overwrite", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    checkpoints = sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_000002"]  # the old run's step_000003 is gone, `latest` is ours
    rows = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]


def wait_for_rows(path: Path, n: int, proc: subprocess.Popen, deadline_s: float = 240) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{path} did not reach {n} rows within {deadline_s} s")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_rl_stops_cleanly_and_says_how_to_resume(tmp_path, own_model_dir, signum):
    out = tmp_path / "out"
    base = ["rl", "--config", str(ROOT / "configs" / "rl_tiny.yaml"), "--model",
            str(own_model_dir), "--output-dir", str(out),
            "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "train.eval_samples=4",
            "train.eval_every=4", "train.checkpoint_every=3", "backend.num_threads=1",
            "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
            f"data.task_dir={tmp_path / 'data'}", "data.arithmetic.n_rl=64",
            "data.arithmetic.n_eval=16"]  # fmt: skip
    proc = subprocess.Popen([str(ROLLOUTS), *base, "--max-steps", "500"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    wait_for_rows(out / "metrics.jsonl", 5, proc)
    os.killpg(proc.pid, signum)  # to the whole process group, as a terminal's Ctrl-C does
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "ExceptionGroup" not in stderr
    assert "abort_request" not in stderr  # the engine was not killed under the trainer's feet
    name = signal.Signals(signum).name
    stopped = next(line for line in stderr.splitlines() if line.startswith("stopped by"))
    assert stopped.startswith(f"stopped by {name} after step ")
    assert f"last checkpoint: {out}/checkpoints/step_" in stopped
    resume = next(line for line in stderr.splitlines() if line.startswith("resume with: "))
    assert resume.startswith("resume with: rollouts rl ") and resume.endswith(" --resume")
    assert engine_processes_for(str(own_model_dir)) == []  # the launched engine was stopped
    # What a person reads: one line per step, no HF save bars or per-step sync lines.
    assert "Writing model shards" not in stderr and "synced weights" not in stderr
    steps_logged = len((out / "metrics.jsonl").read_text().splitlines())
    step_lines = [line for line in stderr.splitlines() if " rollouts: step " in line]
    assert len(step_lines) == steps_logged
    if signum != signal.SIGINT:
        return
    # Resuming replaces the rows logged after the checkpoint instead of repeating them.
    done = rollouts(*base, "--max-steps", str(steps_logged + 2), "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, steps_logged + 3))


def test_rollouts_script_runs_each_command(tmp_path):
    usage = rollouts("--help", cwd=tmp_path, fresh=True)
    assert usage.returncode == 0
    for command in ("sft", "rl", "serve", "eval", "plot", "generate"):
        assert command in usage.stdout
        assert rollouts(command, "--help", cwd=tmp_path, fresh=True).returncode == 0
    assert_error_only(rollouts("trian", cwd=tmp_path, fresh=True), "unknown command 'trian'")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 1 / s}) + "\n" for s in range(1, 4)))  # fmt: skip
    pytest.importorskip("matplotlib")
    plotted = rollouts("plot", str(run), cwd=tmp_path, fresh=True)
    assert plotted.returncode == 0 and (run / "curves.png").is_file()


def test_rollouts_script_is_installed_with_the_package():
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "rollouts"]
    assert script.value == "training.recipes.cli:main"
    assert os.access(ROLLOUTS, os.X_OK)


def test_rollouts_eval_scores_a_model_on_prompts_through_a_launched_engine(tmp_path, own_model_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n"
                            for i in range(6)))  # fmt: skip
    proc = rollouts("eval", "--model", str(own_model_dir), "--data", str(data), "--limit", "4",
                    "--reward", "rollouts.tasks.arithmetic:correctness_reward", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    fields = dict(kv.split("=") for kv in proc.stdout.split())
    assert 0 <= float(fields["accuracy"]) <= 1 and float(fields["n_prompts"]) == 4
    assert engine_processes_for(str(own_model_dir)) == []
    missing = rollouts("eval", "--model", str(own_model_dir), "--data", "none.jsonl", cwd=tmp_path)
    assert_error_only(missing, "--data: none.jsonl: no such file")


async def test_a_launched_engine_is_out_of_reach_of_the_terminals_ctrl_c(tiny_model_dir):
    from engines import launch_engine

    async with launch_engine(model_path=tiny_model_dir, extra_args=["--num-threads", "1"],
                             startup_timeout_s=300) as server:  # fmt: skip
        assert os.getpgid(server.pid) != os.getpgid(0)  # Ctrl-C signals our group, not its


async def test_abort_all_on_an_unreachable_engine_fails_at_once_without_retries(caplog):
    from engines import EngineUnavailableError, SGLangEngine

    async with SGLangEngine(f"http://127.0.0.1:{find_free_port('127.0.0.1')}") as engine:
        with pytest.raises(EngineUnavailableError):
            await engine.abort_all()
    assert not [r for r in caplog.records if "retry" in r.getMessage()]


def test_help_and_config_errors_answer_without_loading_torch(tmp_path):
    # `rollouts --help` or a misspelt key used to load torch and transformers first (~2.5 s of
    # CPU per call, the package imported every export); they need neither. `serve --help` loaded
    # torch through the engine's weight-push routes until they imported it when a group is made.
    probe = ("import sys, contextlib, io\n"
             "from training.recipes.cli import main\n"
             "for argv in (['--help'], ['sft', '--help'], ['rl', '--help'], ['eval', '--help'],\n"
             "             ['serve', '--help'], ['generate', '--help'],\n"
             "             ['sft', 'optim.lrr=1'], ['rl', 'algorithm.name=nope']):\n"
             "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()),"
             " contextlib.redirect_stderr(io.StringIO()):\n"
             "        main(argv)\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_overrides_after_flags_are_read_as_overrides(capsys):
    # issue 42's user wrote `... --output-dir runs/x engines.n_local=2`: argparse refused the
    # trailing overrides ("unrecognized arguments") because others came before the flags
    from training.recipes.cli import main

    for cmd in ("sft", "rl"):
        code = main([cmd, "optim.lr=1e-4", "--max-steps", "2", "--output-dir", "x", "optim.lrr=1"])
        err = capsys.readouterr().err
        assert code == 2 and "unrecognized arguments" not in err, err
        assert "unknown key 'optim.lrr'" in err and "did you mean 'optim.lr'" in err, err


# ----- launchers: plain python, torchrun, and `accelerate launch --multi_gpu` (recipes/launcher.py)

# What accelerate 1.15's launchers put in a process's environment (printed from a real
# `accelerate launch`): its one-process launcher sets MASTER_ADDR/PORT but no RANK/WORLD_SIZE;
# `--multi_gpu` goes through torch.distributed.run and sets torchrun's variables.
ACCELERATE_ONE_PROCESS = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO",
                          "ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": "29500"}  # fmt: skip
ACCELERATE_MULTI_GPU_RANK_1 = {"ACCELERATE_MIXED_PRECISION": "no",
                               "ACCELERATE_DYNAMO_BACKEND": "NO", "RANK": "1", "LOCAL_RANK": "1",
                               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                               "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip


def test_accelerate_multi_gpu_is_a_torchrun_job_and_other_accelerate_launches_name_torchrun():
    from plumbing.errors import ConfigError
    from training.recipes.launcher import check_launcher

    argv = ["examples/run_sft.py", "--config", "configs/sft_tiny.yaml", "optim.lr=1e-4"]
    check_launcher({}, argv)  # plain python
    check_launcher({k: v for k, v in ACCELERATE_MULTI_GPU_RANK_1.items()
                    if not k.startswith("ACCELERATE")}, argv)  # torchrun  # fmt: skip
    check_launcher(ACCELERATE_MULTI_GPU_RANK_1, argv)  # accelerate launch --multi_gpu
    with pytest.raises(ConfigError) as one:
        check_launcher(ACCELERATE_ONE_PROCESS, argv)
    assert "RANK, LOCAL_RANK, WORLD_SIZE unset" in str(one.value)
    assert ("`torchrun --standalone --nproc_per_node N examples/run_sft.py --config "
            "configs/sft_tiny.yaml optim.lr=1e-4`") in str(one.value)  # fmt: skip
    bf16 = {**ACCELERATE_MULTI_GPU_RANK_1, "ACCELERATE_MIXED_PRECISION": "bf16"}
    with pytest.raises(ConfigError, match=r"--mixed_precision bf16 \(rollouts reads model.dtype"
                                          r".*`torchrun --standalone --nproc_per_node 2 "
                                          r"--no-python rollouts sft --max-steps 3`"):  # fmt: skip
        check_launcher(bf16, ["/venv/bin/rollouts", "sft", "--max-steps", "3"])
    nodes = {**ACCELERATE_MULTI_GPU_RANK_1, "ACCELERATE_USE_DEEPSPEED": "true",
             "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1"}  # fmt: skip
    with pytest.raises(ConfigError, match=r"DeepSpeed .*`torchrun --nnodes 2 --node_rank 1 "
                                          r"--master_addr 10.0.0.1 --master_port 29500 "
                                          r"--nproc_per_node 2 examples/run_sft.py"):  # fmt: skip
        check_launcher(nodes, argv)


def test_accelerate_launch_of_one_process_exits_2_naming_the_torchrun_command(tmp_path):
    # The real launcher: `--num_processes 2` without --multi_gpu (always so on a machine
    # without GPUs) started ONE process, which used to train alone without a word.
    accelerate = Path(sys.executable).with_name("accelerate")  # peft's dependency
    assert accelerate.is_file(), "accelerate (a dependency of peft) is not installed"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}  # no accelerate config file of yours
    proc = warm_python.run([accelerate, "launch", "--num_processes", "2", "--cpu",
                            "--num_machines", "1", "--mixed_precision", "no",
                            "--dynamo_backend", "no", ROOT / "examples" / "run_sft.py",
                            "--max-steps", "3", "optim.lr=1e-4"], cwd=tmp_path, env=env,
                           timeout=120)  # fmt: skip
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    script = ROOT / "examples" / "run_sft.py"
    assert (f"`torchrun --standalone --nproc_per_node N {script} --max-steps 3 optim.lr=1e-4`"
            in errors[0]), errors[0]  # fmt: skip
    assert not (tmp_path / "runs").exists()  # refused before anything was written
