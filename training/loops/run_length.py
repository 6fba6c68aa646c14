"""How long an SFT run is: `train.max_steps`, or `train.epochs` over the records, or the default.

What is guaranteed: an epoch-sized run trains on exactly round(epochs x records) samples, so
3 epochs show every record 3 times (each epoch a new permutation, DataBuffer's order); its last
batch is the remainder when that count does not divide by `batch_size`. The batch of each step
depends only on the step number, so a resumed run takes the same batches as an unbroken one.
A step-sized run takes full batches and may end inside an epoch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from training.config import SFTLoopConfig

DEFAULT_EPOCHS = 3  # the length when neither train.max_steps nor train.epochs is given
EVALS_PER_RUN = 10  # with train.eval_every null


class RunLength(NamedTuple):
    """The resolved length of one SFT run."""

    steps: int
    n_samples: int | None  # samples in the whole run when epoch-sized; None: full batches
    batch_size: int
    eval_every: int
    message: str  # the INFO line saying how the length was chosen

    def batch_at(self, step: int) -> int:
        """Samples step `step` (1-based) trains on."""
        if self.n_samples is None:
            return self.batch_size
        return min(self.batch_size, self.n_samples - (step - 1) * self.batch_size)


def sft_run_length(config: SFTLoopConfig, n_records: int) -> RunLength:
    """Resolve `config`'s length over a training set of `n_records` samples.

    Both `max_steps` and `epochs` set is a config error (`SFTLoopConfig` refuses it).
    """
    batch = config.batch_size
    over = f"over {n_records} records (batch_size {batch})"
    if config.max_steps is not None:
        steps, n_samples = config.max_steps, None
        epochs = steps * batch / n_records
        message = f"training {steps} steps = {epochs:.3g} epochs {over} (train.max_steps)"
    else:
        epochs = DEFAULT_EPOCHS if config.epochs is None else config.epochs
        n_samples = max(1, round(epochs * n_records))
        steps = math.ceil(n_samples / batch)
        message = f"training {epochs:g} epoch{'s' * (epochs != 1)} = {steps} steps {over}"
        message += (
            "; set train.epochs or train.max_steps to change"
            if config.epochs is None
            else " (train.epochs)"
        )
    eval_every = config.eval_every or max(1, steps // EVALS_PER_RUN)
    return RunLength(steps, n_samples, batch, eval_every, message)
