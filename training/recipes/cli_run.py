"""How one CLI command runs: output directory, signals, errors, exit codes.

What a person at a terminal gets:
- Bad input (config, data, model path, engine URL, output directory) prints one line per
  cause, `error: <cause>`, and exits 2; nested exception groups are flattened to their causes.
  A bug (an exception that is not a `RolloutsError`) still shows its traceback.
- Ctrl-C or SIGTERM stops the run cleanly (engines stopped, requests aborted, the last complete
  checkpoint kept) and prints the step it stopped at, the checkpoint that survived and the
  command that resumes; exit 130. A second signal stops at once.
- A fresh run into an output directory that already holds a run is refused unless `--resume`
  (continue it) or `--overwrite` (delete its checkpoints and metrics first) is given.

The flags and subcommands that call `run_command` are training/recipes/cli.py.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from plumbing.errors import ConfigError, Interrupted, RolloutsError, leaf_errors

log = logging.getLogger("rollouts.cli")

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


# ----- output directory ------------------------------------------------------------------------

RUN_OUTPUTS = ("checkpoints", "critic", "weights", "metrics.jsonl", "rollouts.jsonl", "reward.png")


def claim_output_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Make sure a run may write into `out`.

    Raises:
        ConfigError: `out` holds an earlier run's checkpoints or metrics and neither `resume`
            nor `overwrite` is set (a fresh run would mix its checkpoints with the old ones,
            and `latest` could name the old run's).
    """
    found = [name for name in RUN_OUTPUTS[:4] if _nonempty(out / name)]
    if not found or resume:
        return
    if not overwrite:
        raise ConfigError(
            f"output_dir {out} already holds a run ({', '.join(found)}): pass --resume to "
            "continue it, --overwrite to delete it and start again, or another --output-dir"
        )
    for name in RUN_OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    log.info("--overwrite: removed the earlier run's outputs in %s", out)


def _nonempty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


# ----- errors and signals ----------------------------------------------------------------------


def print_errors(exc: BaseException) -> bool:
    """Print `error: <message>` once per distinct cause if every cause is a `RolloutsError`.

    Returns False (printing nothing) when some cause is not one: a bug, whose traceback helps.
    """
    leaves = leaf_errors(exc)
    if not all(isinstance(e, RolloutsError) for e in leaves):
        return False
    for message in dict.fromkeys(str(e) for e in leaves):
        print(f"error: {message}", file=sys.stderr)
    return True


@dataclass
class Progress:
    """A logger that remembers the last step logged (for the message after an interrupt)."""

    step: int | None = None

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.step = step


async def run_stoppable(fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run `fn()`; the first SIGINT/SIGTERM cancels it (its cleanup runs), the second raises
    KeyboardInterrupt at once.

    Raises:
        Interrupted: after the cleanup of a run stopped by a signal.
    """
    body = trio.CancelScope()
    received: list[str] = []

    async def watch(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                if received:
                    raise KeyboardInterrupt
                received.append(signal.Signals(signum).name)
                print(f"\n{received[0]}: stopping (engines, requests, checkpoint) — "
                      "press Ctrl-C again to stop at once", file=sys.stderr)  # fmt: skip
                body.cancel()

    result = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch)
            with body:
                result = await fn()
            nursery.cancel_scope.cancel()
    except BaseException as err:
        if received and not any(isinstance(e, KeyboardInterrupt) for e in leaf_errors(err)):
            log.debug("error while stopping", exc_info=err)  # a symptom of the cancellation
            raise Interrupted(received[0]) from None
        raise
    if received:
        raise Interrupted(received[0])
    return result


def resume_command(argv: Sequence[str], prog: str | None) -> str:
    """The command line that resumes the run `argv` started (`--resume` added, `--overwrite` out).

    `prog` is the console command (`rollouts rl`); None: this script, run by `python`.
    """
    head = prog.split() if prog else ["python", sys.argv[0]]
    args = [a for a in argv if a not in ("--overwrite", "--resume")]
    return shlex.join([*head, *args, "--resume"])


def interrupted_message(stop: Interrupted, progress: Progress, output_dir: str | Path,
                        argv: Sequence[str], prog: str | None) -> str:  # fmt: skip
    """Which step the run stopped at, which checkpoint survived, and how to resume."""
    from training.backend.checkpoint import find_latest_checkpoint

    at = ("during set-up, before step 1" if progress.step is None
          else f"after step {progress.step}")  # fmt: skip
    try:
        latest = find_latest_checkpoint(Path(output_dir) / "checkpoints")
    except RolloutsError as err:
        latest, why = None, f" ({err})"
    else:
        why = ""
    if latest is None:
        kept = (f"no checkpoint was written in {Path(output_dir) / 'checkpoints'}{why}; the "
                "resume command starts from step 1")  # fmt: skip
    else:
        kept = f"last checkpoint: {latest}"
    return f"stopped by {stop.signal_name} {at}; {kept}\nresume with: {resume_command(argv, prog)}"


def run_command(argv: Sequence[str], config: Any, recipe: Callable[[Progress], Awaitable[Any]],
                *, overwrite: bool, prog: str | None) -> tuple[int, Any]:  # fmt: skip
    """Claim the output directory, run `recipe(progress)` under `run_stoppable`, report.
    Under torchrun this runs on rank 0; the other ranks serve its backend operations.

    Returns:
        (exit code, the recipe's result or None).
    """
    from training.distributed import run_rank0

    progress = Progress()

    def main() -> Any:
        claim_output_dir(Path(config.output_dir), resume=config.train.resume == "auto",
                         overwrite=overwrite)  # fmt: skip
        return trio.run(run_stoppable, lambda: recipe(progress))

    try:  # under torchrun ranks ≥ 1 serve rank 0's backend operations and get None
        return 0, run_rank0(config.backend, main)
    except BaseException as err:
        # A second Ctrl-C lands wherever the first one's cleanup is, often inside a nursery:
        # it arrives wrapped in an exception group, and is still a stop, not a crash.
        leaves = leaf_errors(err)
        stops = [e for e in leaves if isinstance(e, Interrupted | KeyboardInterrupt)]
        if stops:
            stop = stops[0] if isinstance(stops[0], Interrupted) else Interrupted("SIGINT")
            message = interrupted_message(stop, progress, config.output_dir, argv, prog)
            print(message, file=sys.stderr)
            return EXIT_INTERRUPTED, None
        if print_errors(err):
            return EXIT_ERROR, None
        raise


def run_without_run_dir(fn: Callable[[], Awaitable[Any]]) -> tuple[int, Any]:
    """Run a command that writes no run directory (eval, generate): a signal stops it with one
    line, a `RolloutsError` is one `error:` line.

    Returns:
        (exit code, `fn()`'s result or None).
    """
    try:
        return 0, trio.run(run_stoppable, fn)
    except Interrupted as stop:
        print(f"stopped by {stop.signal_name}", file=sys.stderr)
        return EXIT_INTERRUPTED, None
    except BaseException as err:
        if print_errors(err):
            return EXIT_ERROR, None
        raise
