"""Where a run's metrics go besides metrics.jsonl and the console (the `logging:` section).

Split from training/config.py to keep it under the module budget; training.config re-exports
these names.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollouts.config import Strict


class WandbSettings(Strict):
    """A Weights & Biases run for the metrics (`pip install 'rollouts[wandb]'`).

    ```yaml
    logging:
      wandb: {project: my-project}   # or: logging.wandb.project=my-project
    ```
    """

    project: str = Field(min_length=1)
    entity: str | None = None
    name: str | None = Field(None, description="run name; None: wandb picks one")
    group: str | None = None
    tags: list[str] = []
    mode: Literal["online", "offline", "disabled"] = "online"
    dir: str | None = Field(None, description="where wandb writes its files; None: output_dir")


class TensorBoardSettings(Strict):
    """TensorBoard scalars for the metrics (`pip install 'rollouts[tensorboard]'`)."""

    dir: str | None = Field(None, description="event files; None: <output_dir>/tensorboard")


class LoggingConfig(Strict):
    """Where a run's metrics go besides metrics.jsonl and the console; a section turns one on.

    ```yaml
    logging:
      tensorboard: {}                # or on the command line: logging.tensorboard={}
    ```
    """

    wandb: WandbSettings | None = None
    tensorboard: TensorBoardSettings | None = None
