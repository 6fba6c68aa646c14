"""wandb and TensorBoard are turned on from a run's config (`logging:`) or its dotted
overrides: a missing package fails before the run starts, naming the pip extra; unknown keys are
rejected like every other section; TensorBoard writes the step metrics as event files."""

import json

import pytest

from rollouts.errors import ConfigError
from tests.test_cli import assert_error_only, rollouts, sft_args, write_chats
from training.config import SFTRunConfig, load_config
from training.rl_config import RLRunConfig


def test_wandb_from_the_command_line_without_the_package_fails_naming_the_extra(
    tmp_path, tiny_model_dir, monkeypatch
):
    # wandb is in the dev extra, so hide it from the child: a `wandb` package earlier on its
    # path whose import fails as a missing package's does.
    stub = tmp_path / "no_wandb" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(stub.parent))
    data = str(write_chats(tmp_path / "d.jsonl", 4))
    proc = rollouts(*sft_args(tiny_model_dir, tmp_path, "--data", data, "--max-steps", "1",
                              "logging.wandb.project=demo"), cwd=tmp_path)  # fmt: skip
    assert_error_only(proc, "logging.wandb", "pip install 'rollouts[wandb]'")
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("cls", [SFTRunConfig, RLRunConfig])
def test_logging_sections_reject_unknown_keys_and_are_off_by_default(cls):
    assert cls().logging.wandb is None and cls().logging.tensorboard is None
    on = load_config(cls, None, ["logging.tensorboard={}", "logging.wandb.project=p"])
    assert on.logging.tensorboard.dir is None and on.logging.wandb.project == "p"
    with pytest.raises(ConfigError, match="unknown key 'logging.tensorboard.path'"):
        load_config(cls, None, ["logging.tensorboard.path=x"])
    with pytest.raises(ConfigError, match="unknown key 'logging.mlflow'"):
        load_config(cls, None, ["logging.mlflow.uri=x"])


def test_tensorboard_from_the_config_writes_each_steps_metrics(tmp_path, tiny_model_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = str(write_chats(tmp_path / "d.jsonl", 8))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"logging": {"tensorboard": {}}, "train": {"batch_size": 4}}))
    args = sft_args(tiny_model_dir, tmp_path, "--data", data, "--max-steps", "3")
    args[args.index("--config") + 1] = str(config)
    proc = rollouts(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "out" / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    rows = [json.loads(r) for r in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in rows])
