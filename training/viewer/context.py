"""What the viewer needs from a run besides its data files: a tokenizer and the advantage rule.

Both are found from the run directory itself: the tokenizer of its latest checkpoint (else the
model its `config.yaml` starts from), and the algorithm schedule its `config.yaml` configures.
Either may be missing (a run copied without checkpoints, a config from another version): the
page then shows token ids instead of text, or no advantages, and says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rollouts.types import RolloutBatch
from training.viewer.run_data import Decode

log = logging.getLogger("rollouts.viewer")


def load_run_config(run_dir: Path) -> Any:
    """The run's validated RLRunConfig or SFTRunConfig (by its keys), or None."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if "rollout" in raw:
            from training.rl_config import RLRunConfig

            return RLRunConfig.model_validate(raw)
        from training.config import SFTRunConfig

        return SFTRunConfig.model_validate(raw)
    except Exception as err:  # a config of another version: view the run without it
        log.warning("%s: not read (%s); advantages are not shown", path, err)
        return None


def tokenizer_source(run_dir: Path, config: Any) -> Path | None:
    """A directory with the run's tokenizer: its latest checkpoint, else its start model."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    for candidate in reversed(checkpoints):
        if (candidate / "tokenizer_config.json").is_file():
            return candidate
    model = getattr(getattr(config, "model", None), "path", None)
    if model and (Path(model) / "tokenizer_config.json").is_file():
        return Path(model)
    return None


def load_decoder(run_dir: Path, config: Any) -> Decode | None:
    """`decode(ids) -> text` with the run's tokenizer, or None when none is found."""
    source = tokenizer_source(run_dir, config)
    if source is None:
        log.warning("%s: no tokenizer found (no checkpoint, no model.path): tokens are shown as "
                    "ids", run_dir)  # fmt: skip
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    return lambda ids: tokenizer.decode(ids)


def advantage_rule(config: Any):
    """`(step, batch) -> advantages per group and sample` under the run's algorithm schedule,
    or None (no RL config). PPO's per-token GAE and the pairwise loss give None per sample."""
    if config is None or not hasattr(config, "algorithm"):
        return None
    from training.recipes.rl import algorithm_schedule, generation_budget
    from training.rl.algorithms import compute_advantages
    from training.rl.batch import batch_rewards

    schedule = algorithm_schedule(config.algorithm, generation_budget(config))

    def advantages(step: int, batch: RolloutBatch) -> list[list[float | None]]:
        algorithm = schedule(step, {})
        if algorithm.needs_critic or algorithm.loss == "pairwise" or not batch.groups:
            return [[None] * len(g) for g in batch.groups]
        import torch

        rewards_GN, mask_GN = batch_rewards(batch)
        n_tokens_GN = torch.zeros_like(rewards_GN)
        for g, group in enumerate(batch.groups):
            for n, sample in enumerate(group):
                n_tokens_GN[g, n] = sample.num_trained_tokens
        adv_GN = compute_advantages(algorithm, rewards_GN, n_tokens_GN=n_tokens_GN,
                                    mask_GN=mask_GN)  # fmt: skip
        return [[float(adv_GN[g, n]) for n in range(len(group))]
                for g, group in enumerate(batch.groups)]  # fmt: skip

    return advantages
