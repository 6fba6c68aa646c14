"""RL (GRPO family) against inference engines: local ones started for you, or live SGLang servers.

    python examples/run_rl.py --config configs/rl_tiny.yaml [--engine-url URL ...] [--model DIR]
        [--router-url URL] [--admin-api-key KEY] [--output-dir DIR] [--max-steps N] [--resume]
        [key=value ...]

Without --engine-url it starts from the tiny arithmetic model's SFT checkpoint (running the SFT
recipe first if needed; a stop keeps its checkpoints and the same command resumes it) and
launches local engines on it. With --engine-url and no --model it trains the model the engine
serves (its /model_info model_path, which must be a model directory on this machine too):

    python examples/run_rl.py --config configs/rl_tiny.yaml --engine-url http://127.0.0.1:30000
    python examples/run_rl.py --config configs/rl_tiny.yaml --engine-url URL --model DIR

With --router-url, generation goes
through sgl-model-gateway and weight updates to each worker (--engine-url, or GET /workers).
The last line printed is a summary: held-out accuracy before and after RL, steps and wall time.
"""

import sys

from training.recipes.cli import rl_main

if __name__ == "__main__":
    sys.exit(rl_main(description=__doc__.splitlines()[0]))
