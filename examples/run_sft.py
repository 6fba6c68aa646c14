"""Supervised fine-tuning on a JSONL dataset (default: the tiny model on synthetic arithmetic).

    python examples/run_sft.py --config configs/sft_tiny.yaml [--data PATH.jsonl]
        [--eval-data PATH.jsonl] [--model DIR] [--output-dir DIR] [--max-steps N] [--resume]
        [key=value ...]

Dotted overrides set any config field, e.g. `optim.lr=5e-4 train.batch_size=64`.
The last line printed is a one-line summary of the run.
"""

import sys

import trio

from rollouts.errors import RolloutsError
from training.config import SFTRunConfig, load_config
from training.distributed import run_rank0
from training.loops.loggers import setup_logging
from training.recipes.cli import overrides_from_args, run_parser
from training.recipes.sft import run_sft_recipe


def main() -> int:
    parser = run_parser(__doc__.splitlines()[0],
                        model_help="HF model directory or id (default: the tiny model)")  # fmt: skip
    parser.add_argument("--data", help="SFT JSONL (chat messages or prompt/completion)")
    parser.add_argument("--eval-data", help="held-out SFT JSONL for eval loss")
    args = parser.parse_args()
    overrides = overrides_from_args(
        args, {"data.train_path": args.data, "data.eval_path": args.eval_data}
    )
    setup_logging()
    try:
        config = load_config(SFTRunConfig, args.config, overrides)
        summary = run_rank0(config.backend, lambda: trio.run(run_sft_recipe, config))
    except RolloutsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if summary is None:  # a torchrun rank ≥ 1: it served rank 0's backend operations
        return 0
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
