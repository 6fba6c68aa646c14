"""RL for tool use: the tiny model learns to multiply with a calculator it calls itself.

    python examples/run_tool_rl.py --config configs/tool_tiny.yaml [--max-steps N]
        [--engine-url URL ...] [--model DIR] [--output-dir DIR] [key=value ...]

Without --model it starts from the SFT checkpoint of configs/tool_sft_tiny.yaml (synthetic
tool-use traces; the SFT recipe runs first if it is missing), launches a local engine, and runs
multi-turn episodes: the model's tool calls are parsed and executed, the results appended as
tool turns, and the final answer graded. The last line printed: held-out accuracy and tool-call
success rate before and after RL, steps and wall time.
"""

import sys

from training.recipes.cli import rl_main

if __name__ == "__main__":
    sys.exit(rl_main(description=__doc__.splitlines()[0], default_config="configs/tool_tiny.yaml"))
