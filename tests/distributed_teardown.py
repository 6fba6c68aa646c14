"""A 2-rank job that keeps the default process group alive past its end, as a caller holding a
sharded model past run_rank0 would: `tests/test_torchrun_exit.py` checks that rank 1 then ends
without finalizing its interpreter and that the job still exits 0.

    torchrun --nproc_per_node 2 tests/distributed_teardown.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import logging
import os
import sys
from functools import partial
from pathlib import Path

from plumbing.gc_pause import gc_paused

with gc_paused(freeze=True):  # torch, transformers, the project: plumbing/gc_pause.py
    import torch.distributed as dist
    import trio

    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.config import BackendConfig, OptimConfig
    from training.data.tokenize import tokenize_conversation
    from training.distributed import init_distributed, run_rank0

KEPT = []  # what holds the group here: a module global that outlives the job


async def one_step(model_dir: str, out: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    backend = PyTorchTrainingBackend(
        partial(load_model, model_dir), tokenizer, optim=OptimConfig(lr=1e-3), max_steps=1,
        checkpoint_dir=out / "ckpt", pack_length=64, micro_batch_tokens=128,
    )  # fmt: skip
    messages = [{"role": "user", "content": "1 + 2 = ?"}, {"role": "assistant", "content": "3"}]
    await backend.forward_backward([tokenize_conversation(tokenizer, messages)] * 4).result()
    await backend.optim_step().result()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    config = BackendConfig(num_threads=1)
    init_distributed(config)
    KEPT.append(dist.group.WORLD)
    run_rank0(config, lambda: trio.run(one_step, model_dir, out))
    print(f"rank {os.environ['RANK']} returned", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
