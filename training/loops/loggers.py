"""Metric loggers: plain callables `(step, metrics) -> None`, composed by the caller.

A logger is an extension point (one signature: `Logger`). Shipped: JSONL (one JSON object per
step, appended, so a resumed run continues the same file), console (a tqdm bar on a TTY, one
plain `logging` line per step with elapsed time and ETA otherwise), wandb and TensorBoard
(their packages are optional extras, imported when the logger is created), and `fan_out` to
combine them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plumbing.errors import import_extra
from training.loops.progress import Eta, signal_note

Logger = Callable[[int, dict[str, Any]], None]

log = logging.getLogger("rollouts")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlLogger:
    """Append each step's metrics as one JSON line to `path` (flushed every line).

    A resumed run logs again the steps after its checkpoint: the first row it logs drops the
    file's rows of that step and later ones (a run killed after logging step 130 but
    checkpointed at 100 resumes at 101, and rows 101-130 are replaced, not repeated).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = None

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        if self._file is None:
            self._drop_rows_from(step)
            self._file = self.path.open("a", encoding="utf-8")
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def restore_row(self, step: int, metrics: dict[str, Any]) -> None:
        """Append row `step` from `metrics` unless the file has one: a resumed run passes its
        checkpoint's step and metrics, whose row a run killed between the checkpoint and the
        row (in the step's evaluation, say: SIGKILL runs no `finally`) never wrote."""
        if self.path.is_file():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            if any(_step_of(line) == step for line in lines):
                return
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")
        log.warning("metrics.jsonl had no row of step %d (the run was killed before writing it): "
                    "restored from its checkpoint, without evaluation metrics", step)  # fmt: skip

    def _drop_rows_from(self, step: int) -> None:
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) < step]
        if len(kept) < len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            tmp.replace(self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _step_of(line: str) -> float:
    """The step a metrics row was logged at (-inf for a line that is not one: kept)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("-inf")


def format_metrics(metrics: dict[str, Any], keys: tuple[str, ...]) -> str:
    parts = []
    for key in keys:
        if key in metrics:
            v = metrics[key]
            parts.append(f"{key}={v:.4g}" if isinstance(v, float) else f"{key}={v}")
    return " ".join(parts)


_FAILURE_WORDS = ("failed", "aborted", "retries", "failure")


def shown_evals(evals: dict[str, Any]) -> dict[str, Any]:
    """The evaluation metrics worth a person's eye: failure counters only when not zero, and
    the number scored only when some were not (a row of zeros buried the accuracy)."""
    counters = {k for k in evals if any(w in k for w in _FAILURE_WORDS)}
    troubled = any(evals[k] for k in counters)
    return {k: v for k, v in evals.items() if (v if k in counters else
            troubled or not k.endswith("scored"))}  # fmt: skip


class ConsoleLogger:
    """What a person watches: one progress bar on a terminal, one line per step elsewhere.

    On a terminal (`stream.isatty()`): a tqdm bar whose postfix shows the latest step's `keys`;
    a step with evaluation results (`eval_*` metrics) also prints them as a line above the bar,
    so they stay visible. Off a terminal (a log file, CI): a `logging` line every `every`
    steps (default: each step) and at every evaluation, with the step, the total, the `keys`,
    the time elapsed and the time left at the mean step time so far. A step whose groups all
    had equal rewards says so on its line or bar (`training/rl/signal.py`).
    """

    KEYS = (
        "loss",
        "eval_loss",
        "accuracy",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "padding_efficiency",
    )

    def __init__(self, total_steps: int, *, every: int = 1, initial: int = 0, keys=KEYS,
                 stream: Any = None, tty: bool | None = None,
                 max_wall_s: float | None = None):  # fmt: skip
        self.every = every
        self.keys = keys
        self.total = total_steps
        self._stream = sys.stderr if stream is None else stream
        self._bar = None
        self._eta = Eta(total_steps, max_wall_s=max_wall_s)  # a time cap ends it sooner
        if self._stream.isatty() if tty is None else tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial, dynamic_ncols=True,
                             file=self._stream, unit="step")  # fmt: skip

    # Shown only when not zero: failures a person must notice (a reward that raised, an
    # engine that failed), which are metrics rather than errors.
    WHEN_NONZERO = ("samples_failed", "groups_failed")

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        evals = shown_evals({k: v for k, v in metrics.items() if k.startswith("eval_")})
        failed = tuple(k for k in self.WHEN_NONZERO if metrics.get(k))
        note = signal_note(metrics)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            shown = format_metrics(metrics, (*self.keys, *failed))
            self._bar.set_postfix_str(f"{shown} {note}".rstrip(), refresh=True)
            if evals:
                self._bar.write(f"step {step}: {format_metrics(evals, tuple(evals))}",
                                file=self._stream)  # fmt: skip
        elif step % self.every == 0 or evals:
            keys = (*self.keys, *(k for k in evals if k not in self.keys), *failed)
            shown = " ".join(p for p in (format_metrics(metrics, keys), note) if p)
            log.info("step %d/%d %s [%s]", step, self.total, shown, self._eta.describe(step))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics (strings such as the algorithm name are left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}


class WandbLogger:
    """Log each step's numeric metrics to Weights & Biases (`pip install 'rollouts[wandb]'`).

    Args are passed to `wandb.init` (project, name, config, mode="offline", ...).

    Raises:
        MissingExtraError: wandb is not installed.
    """

    def __init__(self, **init_kwargs: Any):
        wandb = import_extra("wandb", package="wandb", extra="wandb", feature="WandbLogger")
        self._run = wandb.init(**init_kwargs)

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        self._run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class TensorBoardLogger:
    """Write each step's numeric metrics as TensorBoard scalars under `log_dir`.

    Raises:
        MissingExtraError: tensorboard is not installed (`pip install 'rollouts[tensorboard]'`).
    """

    def __init__(self, log_dir: str | Path):
        tb = import_extra("torch.utils.tensorboard", package="tensorboard", extra="tensorboard",
                          feature="TensorBoardLogger")  # fmt: skip
        self._writer = tb.SummaryWriter(log_dir=str(log_dir))

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in _scalars(metrics).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def check_logger_extras(settings: Any) -> None:
    """Fail before a run starts when a logger its config turns on has no package installed.

    Args:
        settings: a `LoggingConfig` (training/config.py).

    Raises:
        MissingExtraError: naming the package and the pip extra that installs it.
    """
    if settings.wandb is not None:
        import_extra("wandb", package="wandb", extra="wandb", feature="logging.wandb")
    if settings.tensorboard is not None:
        import_extra("torch.utils.tensorboard", package="tensorboard", extra="tensorboard",
                     feature="logging.tensorboard")  # fmt: skip


def config_loggers(settings: Any, output_dir: str | Path, run_config: dict[str, Any]
                   ) -> list[Any]:  # fmt: skip
    """The loggers a run's `logging` section turns on (each has `close()`), in order.

    Args:
        settings: a `LoggingConfig`.
        run_config: the resolved run config, recorded as the wandb run's config.

    Raises:
        MissingExtraError: a turned-on logger's package is not installed.
    """
    check_logger_extras(settings)
    out: list[Any] = []
    if settings.wandb is not None:
        w = settings.wandb
        out.append(WandbLogger(project=w.project, entity=w.entity, name=w.name, group=w.group,
                               tags=list(w.tags) or None, mode=w.mode, config=run_config,
                               dir=str(w.dir or output_dir)))  # fmt: skip
    if settings.tensorboard is not None:
        out.append(TensorBoardLogger(settings.tensorboard.dir or Path(output_dir) / "tensorboard"))
    return out


def fan_out(*loggers: Logger) -> Logger:
    """One logger that calls each of `loggers` in order."""

    def log_all(step: int, metrics: dict[str, Any]) -> None:
        for logger in loggers:
            logger(step, metrics)

    return log_all


def setup_logging(level: int = logging.INFO) -> None:
    """Plain timestamped lines on stderr for the `rollouts` logger (call once in a CLI).

    Below DEBUG, the Hugging Face progress bars ("Loading weights", "Writing model shards" at
    every weight export) are turned off: in a log they are most of the lines.
    """
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # one line per request drowns the training log (httpx2: the openai client of agents)
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if level > logging.DEBUG:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when HF loads
        if "transformers" in sys.modules:
            sys.modules["transformers"].utils.logging.disable_progress_bar()
