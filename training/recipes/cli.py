"""The command line: `rollouts sft | rl | serve | eval | plot | generate | view`, and the examples'
entry points.

This module is the flags and the subcommands: a shared run parser, then one `*_main` per
command, then the table `main` dispatches on. How a command runs to its exit code — claiming
the output directory, Ctrl-C / SIGTERM, `error: <cause>` lines and exit codes 2 and 130 — is
training/recipes/cli_run.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from plumbing.errors import RolloutsError
from plumbing.gc_pause import gc_paused
from plumbing.threads import strict_blas
from training.recipes.cli_run import EXIT_ERROR, run_command, run_without_run_dir


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


def load_or_exit(config_cls: type, path: str | None, overrides: list[str]) -> Any:
    """The validated config, or None after printing `error: ...` (then exit 2): a bad config,
    or a launcher the run cannot join (an `accelerate launch` that is not a torchrun job)."""
    from training.config import load_config
    from training.recipes.launcher import check_launcher

    try:
        check_launcher(os.environ, sys.argv)
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

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = run_parser(description, prog=prog,
                        model_help="HF model directory or id (default: the tiny model)")  # fmt: skip
    parser.add_argument("--data", help="SFT JSONL (chat messages or prompt/completion)")
    parser.add_argument("--eval-data", help="held-out SFT JSONL for eval loss")
    parser.add_argument("--epochs", type=float,
                        help="passes over the data (replaces train.max_steps; default: 3 when "
                        "neither is set)")  # fmt: skip
    parser.add_argument("--data-report", help="JSONL listing every record cut or dropped "
                        "(default: OUTPUT_DIR/data_report.jsonl)")  # fmt: skip
    args = parser.parse_intermixed_args(argv)  # overrides may follow flags: `--max-steps 3 k=v`
    if args.epochs is not None and args.max_steps is not None:
        parser.error("--epochs and --max-steps both set the run's length: give one")
    _setup_logging(args)
    data_flags = {"data.train_path": args.data, "data.eval_path": args.eval_data,
                  "data.report_path": args.data_report, "train.epochs": args.epochs}  # fmt: skip
    if args.epochs is not None or args.max_steps is not None:  # a flag replaces the other
        data_flags["train.max_steps" if args.epochs is not None else "train.epochs"] = "null"
    config = load_or_exit(SFTRunConfig, args.config, overrides_from_args(args, data_flags))
    if config is None:
        return EXIT_ERROR
    with gc_paused(freeze=True):  # torch: only once the config is valid (plumbing/gc_pause.py)
        from training.recipes.sft import run_sft_recipe

    code, summary = run_command(argv, config, lambda p: run_sft_recipe(config, on_step=p),
                                overwrite=args.overwrite, prog=prog)  # fmt: skip
    if summary is not None:
        print(summary.line())
    return code


def rl_main(argv: Sequence[str] | None = None, *, prog: str | None = None,
            description: str = "RL (GRPO family) against local or live inference engines.",
            default_config: str | None = None, extensions: Any = None) -> int:  # fmt: skip
    """`rollouts rl` / `examples/run_rl.py`: parse flags, run the RL recipe, print the summary.

    `extensions`: an `RLExtensions` for the recipe (e.g. the agent of `examples/agent_rl.py`).

    Returns the exit code: 0, 2 after printing the errors, 130 after an interrupt.
    """
    import json

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
    args = parser.parse_intermixed_args(argv)  # overrides may follow flags: `--max-steps 3 k=v`
    _setup_logging(args)
    urls = json.dumps(args.engine_url) if args.engine_url else None
    engine_flags = {"engines.urls": urls, "engines.router_url": args.router_url,
                    "engines.admin_api_key": args.admin_api_key}  # fmt: skip
    config = load_or_exit(RLRunConfig, args.config, overrides_from_args(args, engine_flags))
    if config is None:
        return EXIT_ERROR
    if config.engines.exact_logprobs:  # before torch's first matrix product (docs/engines.md)
        strict_blas()
    with gc_paused(freeze=True):  # torch: once the config is valid
        from training.recipes.plot import print_curve, write_reward_png
        from training.recipes.rl import RLExtensions, run_rl_recipe

    config_dir = None if args.config is None else Path(args.config).parent
    code, summary = run_command(argv, config, lambda p: run_rl_recipe(
        config, on_step=p, extensions=extensions or RLExtensions(), config_dir=config_dir),
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
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Greedy held-out accuracy of a model (or checkpoint) on prompts with answers, through a "
        "local engine launched for the purpose (or --engine-url)."))  # fmt: skip
    parser.add_argument("--model", required=True,
                        help="HF model directory, run directory, its checkpoints/ or a checkpoint")  # fmt: skip
    parser.add_argument("--data", required=True, help='any JSONL rollouts rl or sft reads, with '
                        'the ground truth: {"messages" or "prompt", "answer"} per line')  # fmt: skip
    parser.add_argument("--reward", default="rollouts.tasks.arithmetic:correctness_reward",
                        help="module:function scoring a sample (default: arithmetic exact "
                             "match); the module is looked for in the working directory first")  # fmt: skip
    parser.add_argument("--overlong", choices=("drop", "truncate"), default="drop",
                        help="a prompt too long for the context: skip it (default), or keep its "
                             "last tokens")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts")
    parser.add_argument("--engine-url", default=None, help="a live server (default: launch one)")
    parser.add_argument("--answer-field", default="answer", help="ground truth every record has")
    parser.add_argument("--show", type=int, default=0, metavar="N", help="print N scored samples")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    _setup_logging(args)
    with gc_paused(freeze=True):  # torch: not for --help
        from training.recipes.evaluate import evaluate_model

    code, result = run_without_run_dir(lambda: evaluate_model(
        args.model, args.data, args.reward, max_new_tokens=args.max_new_tokens,
        limit=args.limit, engine_url=args.engine_url, answer_field=args.answer_field,
        show=args.show, overlong=args.overlong))  # fmt: skip
    if code == 0:
        metrics, shown = result
        print("\n".join([*shown, " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))]))
    return code


def generate_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts generate`: a model's answers to a prompts or chat file (recipes/generate.py)."""
    with gc_paused(freeze=True):
        from training.recipes.generate import generate_main as main

    return main(argv, prog=prog)


def serve_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts serve`: the local engine (`python -m engines.local`)."""
    with gc_paused(freeze=True):
        from engines.local.__main__ import main

    return main(None if argv is None else list(argv), prog=prog or "rollouts serve")


def tinker_serve_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts tinker-serve`: Tinker's training API on this machine (docs/tinker.md)."""
    with gc_paused(freeze=True):
        from rollouts.tinker_server.serve import main

    return main(argv, prog=prog)


def plot_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts plot RUN_DIR`: curves.png from a run's metrics.jsonl."""
    from training.recipes.plot import main

    return main(argv, prog)


def launch_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts launch`: a Slurm script and Kubernetes manifests for a cluster (docs/cluster.md)."""
    from training.launch.cli import launch_main as main

    return main(argv, prog=prog)


def view_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts view RUN_DIR`: a static site of a run's rollouts and curves (training/viewer)."""
    from training.viewer.cli import main

    return main(argv, prog)


COMMANDS: dict[str, tuple[Callable[..., int], str]] = {
    "sft": (sft_main, "supervised fine-tuning on a JSONL dataset"),
    "rl": (rl_main, "RL (GRPO family) against local or live engines"),
    "serve": (serve_main, "run the local CPU inference engine (SGLang HTTP protocol)"),
    "eval": (eval_main, "greedy held-out accuracy of a model on prompts with answers"),
    "tinker-serve": (tinker_serve_main, "serve Tinker's training API (the `tinker` SDK) here"),
    "plot": (plot_main, "plot a run directory's metrics.jsonl"),
    "generate": (generate_main, "print a model's answers to a prompts or chat JSONL file"),
    "view": (view_main, "a browsable site of a run's rollouts, rewards and curves"),
    "launch": (launch_main, "write (and submit) a Slurm script and K8s manifests for a cluster"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """The `rollouts` console script: `rollouts <command> [flags]`; `rollouts <command> -h`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: rollouts {"
        + ",".join(COMMANDS)
        + "} ...\n\n"
        + "\n".join(f"  {name:<12} {text}" for name, (_, text) in COMMANDS.items())
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
