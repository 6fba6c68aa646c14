"""Command-line plumbing shared by the example entry points (run_sft.py, run_rl.py)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any


def run_parser(description: str, *, model_help: str) -> argparse.ArgumentParser:
    """A parser with the flags every run script has: config, model, output, steps, resume."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=None, help="YAML config (see configs/)")
    parser.add_argument("--model", help=model_help)
    parser.add_argument("--output-dir", help="where checkpoints and metrics.jsonl go")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
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


def rl_main(description: str, *, default_config: str | None = None) -> int:
    """The whole of an RL example script: parse flags, run the RL recipe, print the summary.

    Returns the exit code: 0, or 2 after printing a RolloutsError (bad config, data, engine).
    """
    import json
    import sys

    import trio

    from rollouts.errors import RolloutsError
    from training.config import load_config
    from training.distributed import run_rank0
    from training.loops.loggers import setup_logging
    from training.recipes.plot import print_curve, write_reward_png
    from training.recipes.rl import run_rl_recipe
    from training.rl_config import RLRunConfig

    parser = run_parser(description,
                        model_help="starting HF model directory (default: the SFT checkpoint)")  # fmt: skip
    parser.add_argument("--engine-url", action="append", default=[],
                        help="live SGLang server (repeatable); default: launch local engines")  # fmt: skip
    parser.add_argument("--router-url", default=None,
                        help="sgl-model-gateway for generation; weight syncs go to each worker "
                             "(--engine-url, or the gateway's GET /workers)")  # fmt: skip
    parser.add_argument("--admin-api-key", default=None,
                        help="the engines' --admin-api-key (pause, weight update, abort)")  # fmt: skip
    parser.set_defaults(config=default_config)
    args = parser.parse_args()
    urls = json.dumps(args.engine_url) if args.engine_url else None
    engine_flags = {"engines.urls": urls, "engines.router_url": args.router_url,
                    "engines.admin_api_key": args.admin_api_key}  # fmt: skip
    setup_logging()
    try:
        config = load_config(RLRunConfig, args.config,
                             overrides_from_args(args, engine_flags))  # fmt: skip
        summary = run_rank0(config.backend, lambda: trio.run(run_rl_recipe, config))
    except RolloutsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if summary is None:  # a torchrun rank ≥ 1: it served rank 0's backend operations
        return 0
    print_curve("reward_mean", summary.reward_curve)
    png = write_reward_png(summary.reward_curve, f"{config.output_dir}/reward.png")
    if png:
        print(f"wrote {png}")
    print(summary.line())
    return 0
