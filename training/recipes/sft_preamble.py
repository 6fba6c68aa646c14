"""The SFT run an RL recipe starts from (`sft_config` with `model.path` null), made resumable.

`make rl` and the demo configs start RL from the SFT recipe's checkpoint and run that recipe
first when the checkpoint is missing. That preamble is long (800 steps of the tiny recipe, and
its time grows with the machine's load), so a stop during it must not cost it: here it writes
a checkpoint at least every 1/32 of its steps (25 of the tiny recipe's 800), a stop logs which checkpoint was kept, and
the next run resumes from that checkpoint when it was made by the same recipe on the same data.
Fields that only say how a run is watched or stored (`RUN_ONLY`) do not make a checkpoint
"another recipe's".
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import trio

from training.backend.checkpoint import checkpoint_step, find_latest_checkpoint
from training.config import SFTRunConfig
from training.recipes.cli_run import Progress
from training.recipes.sft import SFTSummary, run_sft_recipe, sft_data_files

log = logging.getLogger("rollouts.rl_recipe")

RUN_ONLY = ("resume", "checkpoint_every", "keep_last", "keep_best", "log_every")
"""`train` fields that change neither the trained weights nor the data cursor."""


def same_recipe(saved: SFTRunConfig | None, sft: SFTRunConfig) -> bool:
    """Whether a checkpoint saved with config `saved` was trained by recipe `sft`."""
    if saved is None:
        return False

    def recipe(config: SFTRunConfig) -> dict[str, Any]:
        dumped = config.model_dump(mode="json")
        for key in RUN_ONLY:
            dumped["train"].pop(key)
        return dumped

    return recipe(saved) == recipe(sft)


def preamble_config(sft: SFTRunConfig, *, resume: bool) -> SFTRunConfig:
    """`sft` with checkpoints at least every 1/32 of its steps, resuming if `resume`."""
    steps = sft.train.max_steps  # null (epoch-sized): unknown before the data is read
    every = sft.train.checkpoint_every if steps is None else min(sft.train.checkpoint_every,
                                                                 max(1, steps // 32))  # fmt: skip
    train = sft.train.model_copy(update={"checkpoint_every": every,
                                         "resume": "auto" if resume else "never"})  # fmt: skip
    return sft.model_copy(update={"train": train})


def resumable(checkpoint: Path | None, sft: SFTRunConfig) -> bool:
    """Whether `checkpoint` is an unfinished run of recipe `sft` on its current data."""
    if checkpoint is None:
        return False
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        extra = dict(state["extra"])
        saved = SFTRunConfig.model_validate(extra["config"])
    except (OSError, ValueError, KeyError, TypeError):  # pydantic's ValidationError: ValueError
        return False
    if checkpoint_step(checkpoint) >= (sft.train.max_steps or extra.get("max_steps", 0)):
        return False
    return same_recipe(saved, sft) and extra.get("data_sha256") == sft_data_files(sft).fingerprint()


async def run_sft_preamble(sft: SFTRunConfig) -> SFTSummary:
    """Run recipe `sft` to its end, resuming an unfinished checkpoint of it.

    Raises:
        trio.Cancelled: after logging which checkpoint was kept and that running the same
            command again resumes from it.
    """
    checkpoints = Path(sft.output_dir) / "checkpoints"
    latest = find_latest_checkpoint(checkpoints)
    resume = resumable(latest, sft)
    if resume:
        log.info("resuming the SFT run from %s", latest)
    progress = Progress()
    config = preamble_config(sft, resume=resume)
    try:
        return await run_sft_recipe(config, on_step=progress)
    except trio.Cancelled:
        kept = find_latest_checkpoint(checkpoints)
        at = "before its first step" if progress.step is None else f"after step {progress.step}"
        if kept is None or (not resume and kept == latest):
            log.warning("the SFT run RL starts from (%s) stopped %s of %d, before its first "
                        "checkpoint (every %d steps): running the same command again starts it "
                        "afresh", sft.output_dir, at, sft.train.max_steps,
                        config.train.checkpoint_every)  # fmt: skip
        else:
            log.warning("the SFT run RL starts from (%s) stopped %s of %d; its checkpoint %s is "
                        "kept: running the same command again resumes the SFT from it, then "
                        "runs RL", sft.output_dir, at, sft.train.max_steps, kept)  # fmt: skip
        raise
