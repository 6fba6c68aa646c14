"""The demo's phases across stops (examples/demo.py): each phase resumes from its own latest
checkpoint, a finished one is skipped (its numbers kept in its folder), and a stop says where
it stopped and how to resume. Split from demo.py, which holds the experiment itself.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollouts.errors import ConfigError
from training.backend.checkpoint import checkpoint_step, find_latest_checkpoint
from training.config import config_to_yaml


@dataclass
class Stage:
    """Where the demo is (for the message after a stop): the phase, its folder, its last step."""

    name: str = "set-up"
    folder: Path | None = None
    step: int | None = None


class StepClock:
    """A logger recording when each step was logged, in seconds since its arm started (just
    before it), so the plot's time axis is the table's wall time.

    With `path`, each step is also appended there; an arm resumed from its checkpoint at step
    `resumed_at` keeps the earlier run's seconds up to that step and continues from them (the
    steps after it are run again, so their time is not counted twice).
    """

    def __init__(self, path: Path | None = None, resumed_at: int = 0,
                 stage: Stage | None = None) -> None:  # fmt: skip
        kept = [(s, t) for s, t in _read_clock(path) if s <= resumed_at] if path else []
        self.offset = kept[-1][1] if kept else 0.0  # seconds the earlier runs spent
        self.t0 = time.perf_counter() - self.offset
        self.seconds: list[tuple[int, float]] = kept
        self._path, self._stage = path, stage
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(f"{s} {t:.3f}\n" for s, t in kept), encoding="utf-8")

    def __call__(self, step: int, metrics: dict) -> None:
        self.seconds.append((step, time.perf_counter() - self.t0))
        if self._path is not None:
            with self._path.open("a", encoding="utf-8") as f:
                f.write(f"{step} {self.seconds[-1][1]:.3f}\n")
        if self._stage is not None:
            self._stage.step = step


def _read_clock(path: Path) -> list[tuple[int, float]]:
    if not path.is_file():
        return []
    rows = [line.split() for line in path.read_text(encoding="utf-8").splitlines()]
    return [(int(r[0]), float(r[1])) for r in rows if len(r) == 2]


RECORD = "demo_phase.json"  # a finished phase's numbers, in its folder


async def run_phase(label: str, config: Any, stage: Stage,
                    run: Callable[[StepClock], Awaitable[dict[str, Any]]]) -> dict[str, Any]:  # fmt: skip
    """Run one phase of the demo in `config.output_dir`, or skip it if an earlier run finished it.

    A phase with checkpoints resumes from its latest complete one (`train.resume=auto`); its
    wall time adds the earlier run's seconds up to that checkpoint. `run(clock)` runs the
    recipe (with `clock` as its `on_step`) and returns the phase's numbers (`wall_s` of this
    call, `line` to print); they are saved in the phase's folder once it is done.

    Raises:
        ConfigError: the folder holds the phase run with other settings.
    """
    folder = Path(config.output_dir)
    saved = folder / "config.yaml"
    if saved.is_file() and saved.read_text(encoding="utf-8") != config_to_yaml(config):
        raise ConfigError(
            f"{folder} holds the demo's {label} phase run with other settings ({saved}); "
            "run again with the same arguments to resume it, or pass --fresh (or another "
            "--out) to start over"
        )
    record_path = folder / RECORD
    if record_path.is_file():
        record = json.loads(record_path.read_text(encoding="utf-8"))
        print(f"{label}: finished in an earlier run ({folder}): skipped. {record['line']}",
              flush=True)  # fmt: skip
        return record
    latest = find_latest_checkpoint(folder / "checkpoints")
    resumed_at = 0 if latest is None else checkpoint_step(latest)
    stage.name, stage.folder, stage.step = label, folder, resumed_at or None
    if latest is not None:
        print(f"{label}: resuming from {latest} (step {resumed_at})", flush=True)
    clock = StepClock(folder / "demo_clock.txt", resumed_at, stage)
    record = await run(clock)
    record |= {"wall_s": record["wall_s"] + clock.offset, "clock": clock.seconds}
    tmp = record_path.with_name(RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    tmp.replace(record_path)  # whole or absent
    print(record["line"], flush=True)
    return record


def stopped_message(signal_name: str, stage: Stage, argv: Sequence[str]) -> str:
    """Where a stopped demo stopped, what it kept, and the command that resumes it."""
    at = f"after step {stage.step}" if stage.step is not None else "before its first step"
    kept = ""
    if stage.folder is not None:
        latest = find_latest_checkpoint(stage.folder / "checkpoints")
        kept = f"; last checkpoint: {latest}" if latest else "; no checkpoint of it yet"
    args = [a for a in argv if a != "--fresh"]
    again = "make demo" + (f" DEMO_ARGS={shlex.quote(shlex.join(args))}" if args else "")
    return f"stopped by {signal_name} during {stage.name} {at}{kept}; resume with `{again}`"
