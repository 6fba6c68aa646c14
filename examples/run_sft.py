"""Supervised fine-tuning on a JSONL dataset (default: the tiny model on synthetic arithmetic).

    python examples/run_sft.py --config configs/sft_tiny.yaml [--data PATH.jsonl]
        [--eval-data PATH.jsonl] [--model DIR] [--output-dir DIR] [--epochs N | --max-steps N]
        [--data-report PATH] [--resume] [key=value ...]

Without --epochs or --max-steps (nor their config keys) the run is 3 epochs over the data.

Dotted overrides set any config field, e.g. `optim.lr=5e-4 train.batch_size=64`.
The last line printed is a one-line summary of the run.
"""

import sys

from training.recipes.cli import sft_main

if __name__ == "__main__":
    sys.exit(sft_main(description=__doc__.splitlines()[0]))
