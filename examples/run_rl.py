"""RL (GRPO family) against inference engines: local ones started for you, or live SGLang servers.

    python examples/run_rl.py --config configs/rl_tiny.yaml [--engine-url URL ...] [--model DIR]
        [--output-dir DIR] [--max-steps N] [--resume] [key=value ...]

Without --engine-url it starts from the tiny arithmetic model's SFT checkpoint (running the SFT
recipe first if needed) and launches local engines on it. The last line printed is a summary:
held-out accuracy before and after RL, steps and wall time.
"""

import json
import sys

import trio

from rollouts.errors import RolloutsError
from training.cli import overrides_from_args, run_parser
from training.config import load_config
from training.loggers import setup_logging
from training.plot import print_curve, write_reward_png
from training.rl_config import RLRunConfig
from training.rl_recipe import run_rl_recipe


def main() -> int:
    parser = run_parser(__doc__.splitlines()[0],
                        model_help="starting HF model directory (default: the SFT checkpoint)")  # fmt: skip
    parser.add_argument("--engine-url", action="append", default=[],
                        help="live SGLang server (repeatable); default: launch local engines")  # fmt: skip
    args = parser.parse_args()
    urls = json.dumps(args.engine_url) if args.engine_url else None
    overrides = overrides_from_args(args, {"engines.urls": urls})
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
