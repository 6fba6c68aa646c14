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
