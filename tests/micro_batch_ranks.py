"""A 2-rank gloo job whose ranks are given different free memory (`ROLLOUTS_FREE_MEMORY_BYTES`,
the what-if figure `micro_batch_tokens: auto` reads instead of the device's): each rank writes
the line `auto` logged on it, and rank 0 the budget its backend took and one step's metrics.
tests/test_micro_batch_size.py checks that both ranks took the smaller rank's choice.

    torchrun --nproc_per_node 2 tests/micro_batch_ranks.py MODEL_DIR OUT_DIR FREE0 FREE1
"""

from __future__ import annotations

import json
import logging
import os
import sys
from functools import partial
from pathlib import Path

from plumbing.gc_pause import gc_paused

with gc_paused(freeze=True):  # torch, transformers, the project: plumbing/gc_pause.py
    import trio

    from training.backend.micro_batch_auto import FREE_MEMORY_ENV
    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.config import BackendConfig, OptimConfig
    from training.data.tokenize import tokenize_conversation
    from training.distributed import run_rank0


class ToFile(logging.Handler):
    """Each `micro_batch_tokens=auto` line logged on this rank, appended to `path`."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if "micro_batch_tokens=auto" in record.getMessage():
            with open(self.path, "a") as f:
                f.write(record.getMessage() + "\n")


async def one_step(model_dir: str, out: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    backend = PyTorchTrainingBackend(
        partial(load_model, model_dir), tokenizer, optim=OptimConfig(lr=1e-3), max_steps=1,
        checkpoint_dir=out / "ckpt", pack_length=64, micro_batch_tokens="auto",
    )  # fmt: skip
    messages = [{"role": "user", "content": "1 + 2 = ?"}, {"role": "assistant", "content": "3"}]
    metrics = await backend.forward_backward(
        [tokenize_conversation(tokenizer, messages)] * 8
    ).result()
    await backend.optim_step().result()
    (out / "rank0.json").write_text(json.dumps({"micro_batch_tokens": backend.micro_batch_tokens,
                                                "loss": metrics["loss"]}))  # fmt: skip
    backend.close()


def main() -> int:
    model_dir, out, *free = sys.argv[1], Path(sys.argv[2]), *sys.argv[3:]
    rank = int(os.environ["RANK"])
    os.environ[FREE_MEMORY_ENV] = free[rank]
    logging.getLogger("rollouts.backend").setLevel(logging.INFO)
    logging.getLogger("rollouts.backend").addHandler(ToFile(out / f"rank{rank}.log"))
    run_rank0(BackendConfig(num_threads=1), lambda: trio.run(one_step, model_dir, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
