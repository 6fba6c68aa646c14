"""`train_rl`: RL from a model, a list of prompts and a reward function, in one call.

The quick start the seed documents promise: nothing to wire. It writes the prompts as JSONL in
the output directory, launches a local engine on the model (or uses `engine_url`), and runs
`run_rl_recipe` with the reward; every other setting is `RLRunConfig`'s default, changed by
dotted `overrides` exactly as on the command line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from rollouts.rewards import RewardFn
from training.config import load_config
from training.recipes.cli_run import claim_output_dir
from training.recipes.rl import RLExtensions, RLSummary, run_rl_recipe
from training.rl_config import RLRunConfig


def quick_rl_config(model: str | Path, prompts: Sequence[str | Mapping[str, Any]] | str | Path,
                    *, output_dir: str | Path = "runs/quick_rl", max_steps: int = 100,
                    algorithm: str = "grpo", engine_url: str | None = None,
                    overrides: Sequence[str] = ()) -> RLRunConfig:  # fmt: skip
    """The run config `train_rl` uses (for `run_rl_recipe` from async code).

    `prompts` as a list is written to `prompts.jsonl` in the run's output directory (the
    `output_dir` argument, or an `output_dir=` override): a string becomes `{"prompt": ...}`,
    a mapping is written as it is, so it may carry an `answer` the reward reads as
    `sample.metadata["answer"]`.
    """
    flags = [f"model.path={model}", f"output_dir={output_dir}", f"train.max_steps={max_steps}",
             f"algorithm.preset={algorithm}"]  # fmt: skip
    if isinstance(prompts, str | Path):
        flags.append(f"data.train_path={prompts}")
    if engine_url is not None:
        flags.append(f"engines.urls={json.dumps([engine_url])}")
    config = load_config(RLRunConfig, None, [*flags, *overrides])
    if isinstance(prompts, str | Path) or config.data.train_path is not None:
        return config
    # written where the run writes, so an `output_dir=` override takes the prompts along
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "prompts.jsonl"
    lines = [json.dumps({"prompt": p} if isinstance(p, str) else dict(p)) for p in prompts]
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    data = config.data.model_copy(update={"train_path": str(path)})
    return config.model_copy(update={"data": data})


def train_rl(model: str | Path, prompts: Sequence[str | Mapping[str, Any]] | str | Path,
             reward_fn: RewardFn, *, output_dir: str | Path = "runs/quick_rl",
             max_steps: int = 100, algorithm: str = "grpo", engine_url: str | None = None,
             resume: bool = False, overwrite: bool = False,
             overrides: Sequence[str] = ()) -> RLSummary:  # fmt: skip
    """Train `model` with RL on `prompts`, scored by `reward_fn`; blocks until done.

    Args:
        model: an HF model directory (or hub id) with a chat template.
        prompts: a list of prompt strings or JSONL records, or the path of a prompts JSONL.
        reward_fn: `(Sample) -> float | {component: float, "total": float}`, sync or async.
        output_dir: checkpoints, metrics.jsonl and the engine's log go here.
        max_steps: optimizer steps (each from `rollout.batch_size` prompts x
            `rollout.n_samples_per_prompt` samples).
        algorithm: a preset name (`grpo`, `dapo`, `dr_grpo`, `gspo`, `cispo`, `rloo`, ...).
        engine_url: a live SGLang server; default: launch a local engine on `model`.
        resume, overwrite: what to do when `output_dir` already holds a run.
        overrides: dotted config overrides, e.g. `["optim.lr=1e-5", "rollout.batch_size=16"]`.

    Returns:
        The run's summary (`.line()` prints it; `.reward_curve` per step).

    Raises:
        ConfigError, DataError, ModelLoadError, EngineError: bad input, named.
    """
    resumed = [*overrides, "train.resume=auto"] if resume else overrides
    config = quick_rl_config(model, prompts, output_dir=output_dir, max_steps=max_steps,
                             algorithm=algorithm, engine_url=engine_url, overrides=resumed)  # fmt: skip
    claim_output_dir(Path(config.output_dir), resume=resume, overwrite=overwrite)
    run = partial(run_rl_recipe, config, extensions=RLExtensions(reward_fn=reward_fn))
    return trio.run(run)
