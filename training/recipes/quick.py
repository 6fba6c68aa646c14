"""`train_rl`: RL from a model, a list of prompts and a reward function, in one call.

The quick start the seed documents promise: nothing to wire. It writes the prompts as JSONL in
the output directory, launches a local engine on the model (or uses `engine_url`), and runs
`run_rl_recipe` with the reward; every other setting is `RLRunConfig`'s default, changed by
dotted `overrides` exactly as on the command line.

Given no held-out prompts, it holds out a few of the prompts it was given (`heldout_split`), so
its summary always has an accuracy before and after: a run that learned nothing says so in
numbers rather than "n/a". Its log lines (one per step, the no-signal warning) reach stderr
even in a program that configured no logging (`console_logging_if_unconfigured`).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from rollouts.rewards import RewardFn
from training.config import load_config
from training.loops.progress import console_logging_if_unconfigured
from training.recipes.cli_run import claim_output_dir
from training.recipes.rl import RLExtensions, RLSummary, run_rl_recipe
from training.rl_config import RLRunConfig

log = logging.getLogger("rollouts.quick")

HELDOUT_SHARE = 0.1  # of the prompts given, held out when no eval prompts are
HELDOUT_MAX = 50  # ... at most: each is one greedy generation before and after training
HELDOUT_SEED = 0


def heldout_split(records: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(train, held out): a deterministic 10 % of `records` (at least 1, at most 50) held out.

    With a single record there is nothing to hold out: it is both (the log line says so).
    """
    if len(records) < 2:
        return list(records), list(records)
    n = max(1, min(HELDOUT_MAX, round(len(records) * HELDOUT_SHARE)))
    held = set(random.Random(HELDOUT_SEED).sample(range(len(records)), n))
    train = [r for i, r in enumerate(records) if i not in held]
    return train, [r for i, r in enumerate(records) if i in held]


def _records(prompts: Sequence[str | Mapping[str, Any]] | str | Path) -> list[Any]:
    if isinstance(prompts, str | Path):
        lines = Path(prompts).read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    return [{"prompt": p} if isinstance(p, str) else dict(p) for p in prompts]


def _write_jsonl(path: Path, records: Sequence[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def quick_rl_config(model: str | Path, prompts: Sequence[str | Mapping[str, Any]] | str | Path,
                    *, output_dir: str | Path = "runs/quick_rl", max_steps: int = 100,
                    algorithm: str = "grpo", engine_url: str | None = None,
                    eval_prompts: Sequence[str | Mapping[str, Any]] | str | Path | None = None,
                    overrides: Sequence[str] = ()) -> RLRunConfig:  # fmt: skip
    """The run config `train_rl` uses (for `run_rl_recipe` from async code).

    `prompts` as a list is written to `prompts.jsonl` in the run's output directory (the
    `output_dir` argument, or an `output_dir=` override): a string becomes `{"prompt": ...}`,
    a mapping is written as it is, so it may carry an `answer` the reward reads as
    `sample.metadata["answer"]`. Unless `eval_prompts` or a `data.eval_path` override names
    held-out prompts, `heldout_split` sets some aside in `heldout.jsonl` there (logged), and
    training uses the rest.
    """
    chosen = eval_prompts is not None or any(o.startswith("data.eval_path=") for o in overrides)
    flags = [f"model.path={model}", f"output_dir={output_dir}", f"train.max_steps={max_steps}",
             f"algorithm.preset={algorithm}"]  # fmt: skip
    if isinstance(prompts, str | Path) and chosen:
        flags.append(f"data.train_path={prompts}")
    if isinstance(eval_prompts, str | Path):
        flags.append(f"data.eval_path={eval_prompts}")
    if engine_url is not None:
        flags.append(f"engines.urls={json.dumps([engine_url])}")
    config = load_config(RLRunConfig, None, [*flags, *overrides])
    # Files go where the run writes, so an `output_dir=` override takes them along.
    out = Path(config.output_dir)
    update: dict[str, str] = {}
    if config.data.train_path is None:
        out.mkdir(parents=True, exist_ok=True)
        records = _records(prompts)
        train, held = (records, None) if chosen else heldout_split(records)
        update["train_path"] = str(_write_jsonl(out / "prompts.jsonl", train))
        if held is not None:
            heldout = _write_jsonl(out / "heldout.jsonl", held)
            update["eval_path"] = str(heldout)
            where = "one prompt: it is also trained on" if len(records) < 2 else str(heldout)
            log.info("held out %d of the %d prompts given (%d %%, at most %d, seed %d) for "
                     "accuracy before/after training, not trained on (%s); pass eval_prompts= "
                     "to choose them", len(held), len(records), HELDOUT_SHARE * 100,
                     HELDOUT_MAX, HELDOUT_SEED, where)  # fmt: skip
    if eval_prompts is not None and not isinstance(eval_prompts, str | Path):
        out.mkdir(parents=True, exist_ok=True)
        update["eval_path"] = str(_write_jsonl(out / "heldout.jsonl", _records(eval_prompts)))
    if not update:
        return config
    return config.model_copy(update={"data": config.data.model_copy(update=update)})


def train_rl(model: str | Path, prompts: Sequence[str | Mapping[str, Any]] | str | Path,
             reward_fn: RewardFn, *, output_dir: str | Path = "runs/quick_rl",
             max_steps: int = 100, algorithm: str = "grpo", engine_url: str | None = None,
             eval_prompts: Sequence[str | Mapping[str, Any]] | str | Path | None = None,
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
        eval_prompts: held-out prompts (as `prompts`) for the accuracy before and after;
            default: 10 % of `prompts` (at most 50, chosen with a fixed seed), not trained on.
        resume, overwrite: what to do when `output_dir` already holds a run.
        overrides: dotted config overrides, e.g. `["optim.lr=1e-5", "rollout.batch_size=16"]`.

    Returns:
        The run's summary (`.line()` prints it; `.reward_curve` per step).

    Raises:
        ConfigError, DataError, ModelLoadError, EngineError: bad input, named.
    """
    resumed = [*overrides, "train.resume=auto"] if resume else overrides
    with console_logging_if_unconfigured():  # a line per step, warnings, the held-out split
        config = quick_rl_config(model, prompts, output_dir=output_dir, max_steps=max_steps,
                                 algorithm=algorithm, engine_url=engine_url,
                                 eval_prompts=eval_prompts, overrides=resumed)  # fmt: skip
        claim_output_dir(Path(config.output_dir), resume=resume, overwrite=overwrite)
        run = partial(run_rl_recipe, config, extensions=RLExtensions(reward_fn=reward_fn))
        return trio.run(run)
