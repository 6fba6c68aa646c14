"""The command line: `rollouts sft | rl | serve | eval | plot`, and the examples' entry points.

What a person at a terminal gets:
- Bad input (config, data, model path, engine URL, output directory) prints one line per
  cause, `error: <cause>`, and exits 2; nested exception groups are flattened to their causes.
  A bug (an exception that is not a `RolloutsError`) still shows its traceback.
- Ctrl-C or SIGTERM stops the run cleanly (engines stopped, requests aborted, the last complete
  checkpoint kept) and prints the step it stopped at, the checkpoint that survived and the
  command that resumes; exit 130. A second signal stops at once.
- A fresh run into an output directory that already holds a run is refused unless `--resume`
  (continue it) or `--overwrite` (delete its checkpoints and metrics first) is given.
"""

from __future__ import annotations

import argparse
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

from rollouts.errors import ConfigError, RolloutsError

log = logging.getLogger("rollouts.cli")

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def run_parser(description: str, *, model_help: str, prog: str | None = None
               ) -> argparse.ArgumentParser:  # fmt: skip
    """A parser with the flags every run command has: config, model, output, steps, resume."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, help="YAML config (see configs/)")
    parser.add_argument("--model", help=model_help)
    parser.add_argument("--output-dir", help="where checkpoints and metrics.jsonl go")
    parser.add_argument("--max-steps", type=int)
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    again.add_argument("--overwrite", action="store_true",
                       help="delete the output directory's checkpoints and metrics first")  # fmt: skip
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging (per-step weight syncs, progress of every save)")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-4")
    return parser


def overrides_from_args(args: argparse.Namespace, extra: Mapping[str, Any] = {}) -> list[str]:
    """Dotted overrides: the positional ones, then one per flag that was given."""
    flags = {
        "model.path": args.model,
        "output_dir": args.output_dir,
        "train.max_steps": args.max_steps,
        "train.resume": "auto" if args.resume else None,
        **extra,
    }
    return [*args.overrides, *(f"{k}={v}" for k, v in flags.items() if v is not None)]


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


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; `exc` itself if not a group."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaf_errors(inner)]
    return [exc]


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


class Interrupted(Exception):
    """The run was stopped by a signal (`signal` is its name, e.g. SIGINT)."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


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
    except (Interrupted, KeyboardInterrupt) as err:
        stop = err if isinstance(err, Interrupted) else Interrupted("SIGINT")
        message = interrupted_message(stop, progress, config.output_dir, argv, prog)
        print(message, file=sys.stderr)
        return EXIT_INTERRUPTED, None
    except BaseException as err:
        if print_errors(err):
            return EXIT_ERROR, None
        raise


def load_or_exit(config_cls: type, path: str | None, overrides: list[str]) -> Any:
    """The validated config, or None after printing `error: ...` (then exit 2)."""
    from training.config import load_config

    try:
        return load_config(config_cls, path, overrides)
    except RolloutsError as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def _setup_logging(args: argparse.Namespace) -> None:
    from training.loops.loggers import setup_logging

    setup_logging(logging.DEBUG if args.verbose else logging.INFO)


# ----- sft, rl ---------------------------------------------------------------------------------


def sft_main(argv: Sequence[str] | None = None, *, prog: str | None = None,
             description: str = "Supervised fine-tuning on a JSONL dataset.") -> int:  # fmt: skip
    """`rollouts sft` / `examples/run_sft.py`: parse flags, run the SFT recipe, print the summary.

    Returns the exit code: 0, 2 after printing the errors, 130 after an interrupt.
    """
    from training.config import SFTRunConfig
    from training.recipes.sft import run_sft_recipe

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = run_parser(description, prog=prog,
                        model_help="HF model directory or id (default: the tiny model)")  # fmt: skip
    parser.add_argument("--data", help="SFT JSONL (chat messages or prompt/completion)")
    parser.add_argument("--eval-data", help="held-out SFT JSONL for eval loss")
    args = parser.parse_args(argv)
    _setup_logging(args)
    data_flags = {"data.train_path": args.data, "data.eval_path": args.eval_data}
    config = load_or_exit(SFTRunConfig, args.config, overrides_from_args(args, data_flags))
    if config is None:
        return EXIT_ERROR
    code, summary = run_command(argv, config, lambda p: run_sft_recipe(config, on_step=p),
                                overwrite=args.overwrite, prog=prog)  # fmt: skip
    if summary is not None:
        print(summary.line())
    return code


def rl_main(argv: Sequence[str] | None = None, *, prog: str | None = None,
            description: str = "RL (GRPO family) against local or live inference engines.",
            default_config: str | None = None) -> int:  # fmt: skip
    """`rollouts rl` / `examples/run_rl.py`: parse flags, run the RL recipe, print the summary.

    Returns the exit code: 0, 2 after printing the errors, 130 after an interrupt.
    """
    import json

    from training.recipes.plot import print_curve, write_reward_png
    from training.recipes.rl import run_rl_recipe
    from training.rl_config import RLRunConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = run_parser(description, prog=prog,
                        model_help="starting HF model directory (default: the SFT checkpoint)")  # fmt: skip
    parser.add_argument("--engine-url", action="append", default=[],
                        help="live SGLang server (repeatable); default: launch local engines")  # fmt: skip
    parser.add_argument("--router-url", default=None,
                        help="sgl-model-gateway for generation; weight syncs go to each worker "
                             "(--engine-url, or the gateway's GET /workers)")  # fmt: skip
    parser.add_argument("--admin-api-key", default=None,
                        help="the engines' --admin-api-key (pause, weight update, abort)")  # fmt: skip
    parser.set_defaults(config=default_config)
    args = parser.parse_args(argv)
    _setup_logging(args)
    urls = json.dumps(args.engine_url) if args.engine_url else None
    engine_flags = {"engines.urls": urls, "engines.router_url": args.router_url,
                    "engines.admin_api_key": args.admin_api_key}  # fmt: skip
    config = load_or_exit(RLRunConfig, args.config, overrides_from_args(args, engine_flags))
    if config is None:
        return EXIT_ERROR
    code, summary = run_command(argv, config, lambda p: run_rl_recipe(config, on_step=p),
                                overwrite=args.overwrite, prog=prog)  # fmt: skip
    if summary is None:
        return code
    print_curve("reward_mean", summary.reward_curve)
    png = write_reward_png(summary.reward_curve, f"{config.output_dir}/reward.png")
    if png:
        print(f"wrote {png}")
    print(summary.line())
    return code


# ----- eval, serve, plot -----------------------------------------------------------------------


def eval_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts eval`: greedy accuracy of a model on RL-format prompts, via a local engine."""
    from training.recipes.evaluate import evaluate_model

    parser = argparse.ArgumentParser(prog=prog, description=(
        "Greedy held-out accuracy of a model (or checkpoint) on prompts with answers, through a "
        "local engine launched for the purpose (or --engine-url)."))  # fmt: skip
    parser.add_argument("--model", required=True, help="HF model or checkpoint directory")
    parser.add_argument("--data", required=True,
                        help='prompts JSONL: {"messages" or "prompt", "answer"} per line')  # fmt: skip
    parser.add_argument("--reward", default="rollouts.tasks.arithmetic:correctness_reward",
                        help="module:function scoring a sample (default: arithmetic exact match)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts")
    parser.add_argument("--engine-url", default=None, help="a live server (default: launch one)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    _setup_logging(args)
    try:
        metrics = trio.run(run_stoppable, lambda: evaluate_model(
            args.model, args.data, args.reward, max_new_tokens=args.max_new_tokens,
            limit=args.limit, engine_url=args.engine_url))  # fmt: skip
    except Interrupted as stop:
        print(f"stopped by {stop.signal_name}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as err:
        if print_errors(err):
            return EXIT_ERROR
        raise
    print(" ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
    return 0


def serve_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts serve`: the local engine (`python -m engines.local`)."""
    from engines.local.__main__ import main

    return main(None if argv is None else list(argv))


def plot_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts plot RUN_DIR`: curves.png from a run's metrics.jsonl."""
    from training.recipes.plot import main

    return main(argv, prog)


COMMANDS: dict[str, tuple[Callable[..., int], str]] = {
    "sft": (sft_main, "supervised fine-tuning on a JSONL dataset"),
    "rl": (rl_main, "RL (GRPO family) against local or live engines"),
    "serve": (serve_main, "run the local CPU inference engine (SGLang HTTP protocol)"),
    "eval": (eval_main, "greedy held-out accuracy of a model on prompts with answers"),
    "plot": (plot_main, "plot a run directory's metrics.jsonl"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """The `rollouts` console script: `rollouts <command> [flags]`; `rollouts <command> -h`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: rollouts {"
        + ",".join(COMMANDS)
        + "} ...\n\n"
        + "\n".join(f"  {name:<6} {text}" for name, (_, text) in COMMANDS.items())
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else EXIT_ERROR
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"error: unknown command {argv[0]!r}\n{usage}", file=sys.stderr)
        return EXIT_ERROR
    fn, _ = command
    return fn(argv[1:], prog=f"rollouts {argv[0]}")
