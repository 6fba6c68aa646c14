"""Two backends in turn in one torchrun job, as a benchmark, a sweep or a notebook builds them:
the first trains a step, is closed and dropped, then the second is built and trains a step.
Every rank prints when it builds and when it frees a model, so `tests/test_distributed.py` can
check that each rank let the first model go before it built the second (on a GPU the first
model's weights, gradients and AdamW state would otherwise stay until the job ends).

    python tests/distributed_release.py MODEL_DIR OUT_DIR   (as each rank of a job)
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import sys
import weakref
from functools import partial
from pathlib import Path

from plumbing.gc_pause import gc_paused

with gc_paused(freeze=True):  # torch, transformers, the project: plumbing/gc_pause.py
    import trio

    from training.backend.pytorch import (
        BackendError,
        PyTorchTrainingBackend,
        load_model,
        load_tokenizer,
    )
    from training.config import BackendConfig, OptimConfig
    from training.data.tokenize import tokenize_conversation
    from training.distributed import init_distributed, run_rank0

_BUILT = itertools.count()


def watched_model(model_dir: str):
    """load_model, announcing the build and (when it is collected) the model's end."""
    model = load_model(model_dir)
    n, rank = next(_BUILT), os.environ["RANK"]
    print(f"rank {rank} built model {n}", flush=True)
    weakref.finalize(model, print, f"rank {rank} freed model {n}", flush=True)
    return model


async def train_two_in_turn(model_dir: str, out: Path) -> None:
    import distributed_release as me  # by import path, so the other ranks can build it too

    tokenizer = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": "1 + 2 = ?"}, {"role": "assistant", "content": "3"}]
    samples = [tokenize_conversation(tokenizer, messages)] * 4
    for n in range(2):
        backend = PyTorchTrainingBackend(
            partial(me.watched_model, model_dir), tokenizer, optim=OptimConfig(lr=1e-3),
            max_steps=1, checkpoint_dir=out / f"ckpt{n}", pack_length=64, micro_batch_tokens=128,
        )  # fmt: skip
        await backend.forward_backward(samples).result()
        await backend.optim_step().result()
        backend.close()
        try:
            backend.forward(samples)
        except BackendError as err:
            print(f"rank 0 closed backend {n}: {err}", flush=True)
        del backend
        gc.collect()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    config = BackendConfig(num_threads=1)
    init_distributed(config)
    run_rank0(config, lambda: trio.run(train_two_in_turn, model_dir, out))
    print(f"rank {os.environ['RANK']} returned", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
