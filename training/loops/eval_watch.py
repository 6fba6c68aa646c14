"""EvalWatch: the lowest held-out loss of an SFT run so far, and an overfitting warning.

What is guaranteed: `observe` is called at every evaluation with the eval loss and the mean
train loss of the steps since the previous evaluation. It returns whether the eval loss is the
lowest yet (the recipe then marks that step's checkpoint as the best), and logs ONE warning
per run when the eval loss rose at `patience` evaluations in a row while the train loss fell at
each: the run is overfitting; the warning names the step with the lowest eval loss. The state
travels in checkpoints, so a resumed run keeps its best step and its count of rises.

Not covered: noise. A rise is any increase; with few eval samples, raise `patience`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("rollouts.sft")

PATIENCE = 3  # rises in a row before the warning


@dataclass
class EvalWatch:
    """Mutable: the best eval so far and the current run of rises (see the module docstring)."""

    patience: int = PATIENCE
    best_step: int | None = None
    best_eval_loss: float | None = None
    last_eval_loss: float | None = None
    last_train_loss: float | None = None
    rising: list[tuple[int, float, float]] = field(default_factory=list)  # (step, eval, train)
    warned: bool = False

    def observe(self, step: int, eval_loss: float, train_loss: float | None) -> bool:
        """Record one evaluation; True when `eval_loss` is the lowest so far."""
        if self.last_eval_loss is not None:
            rose = eval_loss > self.last_eval_loss
            fell = (train_loss is not None and self.last_train_loss is not None
                    and train_loss < self.last_train_loss)  # fmt: skip
            self.rising = [*self.rising, (step, eval_loss, train_loss)] if rose and fell else []
        self.last_eval_loss, self.last_train_loss = eval_loss, train_loss
        best = self.best_eval_loss is None or eval_loss < self.best_eval_loss
        if best:
            self.best_step, self.best_eval_loss = step, eval_loss
        if len(self.rising) >= self.patience and not self.warned:
            self.warned = True
            log.warning("%s", self.overfitting_message())
        return best

    def overfitting_message(self) -> str:
        steps = ", ".join(str(s) for s, _, _ in self.rising)
        evals = " → ".join(f"{e:.4f}" for _, e, _ in self.rising)
        trains = " → ".join(f"{t:.4f}" for _, _, t in self.rising)
        return (
            f"eval loss rose at {len(self.rising)} evaluations in a row (steps {steps}: "
            f"{evals}) while train loss fell ({trains}): the model is overfitting the training "
            f"data. The lowest eval loss was {self.best_eval_loss:.4f} at step {self.best_step}; "
            "train fewer epochs (train.epochs) or steps, or keep that step's weights "
            "(train.keep_best: true keeps checkpoints/best)"
        )

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, [tuple(r) for r in value] if key == "rising" else value)
