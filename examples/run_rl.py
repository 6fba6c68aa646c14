"""RL (GRPO family) against inference engines: local ones started for you, or live SGLang servers.

    python examples/run_rl.py --config configs/rl_tiny.yaml [--engine-url URL ...] [--model DIR]
        [--router-url URL] [--admin-api-key KEY] [--output-dir DIR] [--max-steps N] [--resume]
        [key=value ...]

Without --engine-url it starts from the tiny arithmetic model's SFT checkpoint (running the SFT
recipe first if needed) and launches local engines on it. With --router-url, generation goes
through sgl-model-gateway and weight updates to each worker (--engine-url, or GET /workers).
The last line printed is a summary: held-out accuracy before and after RL, steps and wall time.
"""

import sys

from training.recipes.cli import rl_main

if __name__ == "__main__":
    sys.exit(rl_main(description=__doc__.splitlines()[0]))
