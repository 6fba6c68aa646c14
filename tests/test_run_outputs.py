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
    written, held = (
        tmp_path / "elsewhere" / "prompts.jsonl",
        tmp_path / "elsewhere" / "heldout.jsonl",
    )
    assert (config.data.train_path, config.data.eval_path) == (str(written), str(held))
    prompts = [json.loads(x)["prompt"] for f in (written, held) for x in f.read_text().splitlines()]
    assert sorted(prompts) == ["1+1", "2+2"]  # one of the two is held out for before/after
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


def test_launched_engines_take_device_and_dtype_from_the_engines_section():
    # One GPU with a launched engine: `engines.local_device=cuda` must reach `rollouts serve`,
    # which parses the flags exactly as a person typing them would.
    from engines.local.__main__ import build_parser
    from training.config import load_config
    from training.recipes.rl_engines import local_engine_args
    from training.rl_config import RLRunConfig

    default = load_config(RLRunConfig, None, []).engines
    gpu = load_config(RLRunConfig, None, ["engines.local_device=cuda",
                                          "engines.local_dtype=bfloat16"]).engines  # fmt: skip
    for ec, device, dtype in ((default, "cpu", "float32"), (gpu, "cuda", "bfloat16")):
        args = build_parser().parse_args(["--model-path", "m", *local_engine_args(ec)])
        assert (args.device, args.dtype, args.num_threads) == (device, dtype, 1)
