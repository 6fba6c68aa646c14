"""Supervised fine-tuning on a JSONL dataset (default: the tiny model on synthetic arithmetic).

    python examples/run_sft.py --config configs/sft_tiny.yaml [--data PATH.jsonl]
        [--eval-data PATH.jsonl] [--model DIR] [--output-dir DIR] [--max-steps N] [--resume]
        [key=value ...]

Dotted overrides set any config field, e.g. `optim.lr=5e-4 train.batch_size=64`.
The last line printed is a one-line summary of the run.
"""

import argparse
import sys

import trio

from rollouts.errors import RolloutsError
from training.config import SFTRunConfig, load_config
from training.loggers import setup_logging
from training.recipes import run_sft_recipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML config (see configs/)")
    parser.add_argument("--data", help="SFT JSONL (chat messages or prompt/completion)")
    parser.add_argument("--eval-data", help="held-out SFT JSONL for eval loss")
    parser.add_argument("--model", help="HF model directory or id (default: the tiny model)")
    parser.add_argument("--output-dir", help="where checkpoints and metrics.jsonl go")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-4")
    args = parser.parse_args()

    overrides = list(args.overrides)
    flag_overrides = {
        "data.train_path": args.data,
        "data.eval_path": args.eval_data,
        "model.path": args.model,
        "output_dir": args.output_dir,
        "train.max_steps": args.max_steps,
        "train.resume": "auto" if args.resume else None,
    }
    overrides += [f"{k}={v}" for k, v in flag_overrides.items() if v is not None]
    setup_logging()
    try:
        config = load_config(SFTRunConfig, args.config, overrides)
        summary = trio.run(run_sft_recipe, config)
    except RolloutsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
