"""Write a tiny randomly initialised HF causal LM + tokenizer to a directory (no download).

python examples/make_tiny_model.py --output runs/tiny_model [--seed 0] [--size tiny|small]
    [--template chatml|qwen3]
"""

import argparse

from training.backend.tiny_model import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="directory to write the model to")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (tokenizer fixed)")
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--template", choices=["chatml", "qwen3"], default="chatml",
                        help="chat template; qwen3: Qwen3's thinking rules (earlier reasoning dropped)")  # fmt: skip
    args = parser.parse_args()
    path = build_tiny_model(args.output, seed=args.seed, size=args.size, template=args.template)
    print(f"wrote {args.size} model (seed {args.seed}) to {path}")


if __name__ == "__main__":
    main()
