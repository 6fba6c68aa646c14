"""A run writes only inside its output directory, and only once its inputs are valid; a
launched engine leaves nothing behind in the temp directory and logs no deprecation noise."""

import json
import tempfile
from pathlib import Path

from tests.test_cli import ROOT, assert_error_only, rollouts, sft_args
from training.recipes.quick import quick_rl_config


def test_quick_rl_prompts_are_written_into_the_overridden_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = quick_rl_config("some/model", ["1+1", {"prompt": "2+2", "answer": "4"}],
                             overrides=[f"output_dir={tmp_path / 'elsewhere'}"])  # fmt: skip
    written = tmp_path / "elsewhere" / "prompts.jsonl"
    assert config.data.train_path == str(written)
    assert [json.loads(x)["prompt"] for x in written.read_text().splitlines()] == ["1+1", "2+2"]
    assert not (tmp_path / "runs").exists()  # the default runs/quick_rl was not touched


def test_a_run_whose_data_fails_validation_creates_no_output_dir(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "1+1"}\n')  # malformed for SFT and for RL
    sft = rollouts(*sft_args(tiny_model_dir, tmp_path, "--data", str(bad)), cwd=tmp_path)
    assert_error_only(sft, f"invalid record(s) in {bad}")
    rl = rollouts("rl", "--config", str(ROOT / "configs" / "rl_tiny.yaml"), "--model",
                  str(tiny_model_dir), "--output-dir", str(tmp_path / "out"),
                  f"data.train_path={bad}", "data.eval_path=null", cwd=tmp_path)  # fmt: skip
    assert_error_only(rl, f"invalid record(s) in {bad}")
    assert not (tmp_path / "out").exists()


def test_serve_help_names_the_rollouts_command(tmp_path):
    proc = rollouts("serve", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: rollouts serve ")


async def test_a_launched_engine_warns_nothing_and_leaves_no_temp_log(tiny_model_dir):
    from engines import launch_engine

    async with launch_engine(model_path=tiny_model_dir, extra_args=["--num-threads", "1"],
                             startup_timeout_s=120) as server:  # fmt: skip
        log = server.log_path
        assert log.parent == Path(tempfile.gettempdir()) and log.is_file()
        text = log.read_text()  # the health check has run a forward pass
    assert "Warning" not in text, text
    assert not log.exists()
