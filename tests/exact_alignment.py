"""How many of 50 random sequences get other exact-mode logprobs when the model's weights sit at
other memory offsets (as FSDP2's gathered parameters do), in a fresh process.

    python tests/exact_alignment.py MODEL_DIR [--strict]   # prints "differ N/50"

`--strict` first calls `plumbing.threads.strict_blas()`, as the exact mode does at start.
"""

from __future__ import annotations

import random
import sys

if "--strict" in sys.argv:
    from plumbing.threads import strict_blas

    strict_blas()

import torch
from transformers import AutoModelForCausalLM

from training.data.exact_scoring import score_alone


def moved(model: torch.nn.Module, offset_floats: int) -> torch.nn.Module:
    """`model` with each weight copied to a fresh buffer, `offset_floats` past its start."""
    with torch.no_grad():
        for p in model.parameters():
            buf = torch.empty(p.numel() + 16)
            view = buf[offset_floats : offset_floats + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
    return model


def main() -> None:
    torch.set_num_threads(1)
    loaded = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    others = [moved(AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval(), k) for k in (0, 1)]
    rng, vocab, differ = random.Random(0), loaded.config.vocab_size, 0
    with torch.inference_mode():
        for _ in range(50):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(10, 40))]
            output = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            want = score_alone(loaded, prompt, output)
            differ += any(score_alone(m, prompt, output) != want for m in others)
    print(f"differ {differ}/50")


if __name__ == "__main__":
    main()
