"""Optional loggers and plots: a clear error naming the extra when the package is missing; the
real thing when it is installed; `python -m training.recipes.plot RUN_DIR` writes a PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollouts.errors import MissingExtraError
from training.loops.loggers import JsonlLogger, TensorBoardLogger, WandbLogger
from training.recipes.plot import plot_training_curves

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize(
    ("make", "blocked", "extra"),
    [
        (lambda tmp: WandbLogger(project="x", dir=str(tmp)), ["wandb"], "wandb"),
        (
            lambda tmp: TensorBoardLogger(tmp),
            ["tensorboard", "torch.utils.tensorboard"],
            "tensorboard",
        ),
    ],
)
def test_a_missing_logger_package_names_the_extra_to_install(
    make, blocked, extra, tmp_path, monkeypatch
):
    for module in blocked:
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(MissingExtraError, match=rf"pip install 'rollouts\[{extra}\]'") as err:
        make(tmp_path)
    assert isinstance(err.value, ImportError)


def test_tensorboard_logger_writes_numeric_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    logger(1, {"loss": 0.5, "algorithm": "grpo"})
    logger(2, {"loss": 0.25})
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]


def test_wandb_logger_logs_each_step_offline(tmp_path):
    pytest.importorskip("wandb")
    logger = WandbLogger(project="rollouts-test", mode="offline", dir=str(tmp_path))
    logger(1, {"loss": 0.5, "algorithm": "grpo"})
    logger.close()
    assert any(tmp_path.rglob("*.wandb"))


def write_metrics(run_dir: Path) -> Path:
    logger = JsonlLogger(run_dir / "metrics.jsonl")
    for step in range(1, 6):
        logger(step, {"reward_mean": step / 5, "loss": 1 / step, "reward/correct": step / 10,
                      "algorithm": "grpo", "kl": float("nan")})  # fmt: skip
    logger.close()
    return run_dir / "metrics.jsonl"


def test_plot_training_curves_writes_a_png_beside_the_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_training_curves(write_metrics(tmp_path))
    assert out == tmp_path / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_plot_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'rollouts\[plot\]'"):
        plot_training_curves(write_metrics(tmp_path))


def test_plot_module_runs_on_a_run_directory(tmp_path):
    pytest.importorskip("matplotlib")
    write_metrics(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "training.recipes.plot", str(tmp_path),
                           "--keys", "reward_mean,reward/correct"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "curves.png")
    bad = subprocess.run([sys.executable, "-m", "training.recipes.plot", str(tmp_path), "--keys", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 1 and "no numeric values for any of ['nope']" in bad.stderr


def test_a_long_reward_curve_prints_as_window_means(capsys):
    from training.recipes.plot import print_curve, window_means

    assert window_means([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [2.0, 4.5]
    print_curve("reward_mean", [i / 599 for i in range(600)], width=60)
    first, second = capsys.readouterr().out.splitlines()
    bars = first.split(": ")[1]
    assert first.startswith("reward_mean (600 steps)") and len(bars) == 60
    assert bars[0] == "▁" and bars[-1] == "█"
    assert second.split()[-1] == f"{sum(i / 599 for i in range(540, 600)) / 60:.3f}"


def test_plotted_curves_are_titled_with_the_run_and_its_last_step(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "my_run"
    run.mkdir()
    out = plot_training_curves(write_metrics(run), tmp_path / "curves.svg")
    assert "<!-- my_run: 5 steps -->" in out.read_text()  # the SVG names each text it draws
