"""RL (GRPO family) against inference engines: local ones started for you, or live SGLang servers.

    python examples/run_rl.py --config configs/rl_tiny.yaml [--engine-url URL ...] [--model DIR]
        [--output-dir DIR] [--max-steps N] [--resume] [key=value ...]

Without --engine-url it starts from the tiny arithmetic model's SFT checkpoint (running the SFT
recipe first if needed) and launches local engines on it. The last line printed is a summary:
held-out accuracy before and after RL, steps and wall time.
"""

import argparse
import json
import sys

import trio

from rollouts.errors import RolloutsError
from training.config import load_config
from training.loggers import setup_logging
from training.plot import print_curve, write_reward_png
from training.rl_config import RLRunConfig
from training.rl_recipe import run_rl_recipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML config (see configs/)")
    parser.add_argument("--engine-url", action="append", default=[],
                        help="live SGLang server (repeatable); default: launch local engines")  # fmt: skip
    parser.add_argument("--model", help="starting HF model directory (default: the SFT checkpoint)")
    parser.add_argument("--output-dir", help="where checkpoints and metrics.jsonl go")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-5")
    args = parser.parse_args()

    overrides = list(args.overrides)
    flags = {
        "model.path": args.model,
        "output_dir": args.output_dir,
        "train.max_steps": args.max_steps,
        "train.resume": "auto" if args.resume else None,
        "engines.urls": json.dumps(args.engine_url) if args.engine_url else None,
    }
    overrides += [f"{k}={v}" for k, v in flags.items() if v is not None]
    setup_logging()
    try:
        config = load_config(RLRunConfig, args.config, overrides)
        summary = trio.run(run_rl_recipe, config)
    except RolloutsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_curve("reward_mean per step", summary.reward_curve)
    png = write_reward_png(summary.reward_curve, f"{config.output_dir}/reward.png")
    if png:
        print(f"wrote {png}")
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
