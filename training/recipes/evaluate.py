"""`rollouts eval`: greedy held-out accuracy of a model (or checkpoint) through an engine.

The engine is a local one launched on the model for the purpose (stopped at the end), or a
live server given by URL (probed once first). Prompts are any file `rollouts rl` or `rollouts
sft` reads (training/recipes/prompt_files.py: a chat's last assistant turn is cut off), plus
the ground truth the reward reads, `answer` by default: a record without it is an error
before any engine starts, since a reward cannot score it. A prompt too long for the model's
context is skipped (or cut) with a warning naming its line, as `rollouts generate` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from plumbing.model_paths import resolve_model_dir
from rollouts.errors import DataError
from rollouts.evaluation import evaluate_greedy
from rollouts.prompts import PromptItem
from rollouts.types import Sample
from training.backend.model_io import load_tokenizer
from training.recipes.callables import resolve_callable
from training.recipes.generate import format_sample, open_model_engine, prompt_limit
from training.recipes.prompt_files import Overlong, load_prompt_file
from training.recipes.sft import check_input_file


def check_scorable(prompts: Sequence[PromptItem], field: str) -> None:
    """Every record must carry the ground truth the reward reads, or the scores mean nothing.

    Raises:
        DataError: naming how many records lack `field` and the first ones (file:line).
    """
    missing = [p.source for p in prompts if field not in p.metadata]
    if missing:
        more = f" and {len(missing) - 3} more" * (len(missing) > 3)
        raise DataError(
            f"{', '.join(missing[:3])}{more}: {field}: missing ({len(missing)} of {len(prompts)} "
            f"records): rollouts eval scores records against their {field!r} (--answer-field); "
            "to read a model's answers to records without one, use rollouts generate"
        )


async def evaluate_model(model: str, data: str, reward: str, *, max_new_tokens: int = 16,
                         limit: int | None = None, engine_url: str | None = None,
                         answer_field: str = "answer", show: int = 0,
                         overlong: Overlong = "drop"
                         ) -> tuple[dict[str, float], list[str]]:  # fmt: skip
    """One greedy episode per prompt, scored by `reward` (`module:function`).

    Args:
        answer_field: the ground-truth key every record must have (what the reward reads).
        show: how many scored samples to return formatted for printing (the first ones).
        overlong: a prompt too long for the context: "drop" (skip it) or "truncate".

    Returns:
        The metrics (`accuracy`, `reward_mean`, tool metrics for tool episodes, `n_prompts`),
        and `show` samples as printable blocks (prompt, answer, expected, score).

    Raises:
        ConfigError: a missing data file or unresolvable reward.
        DataError: malformed records, or records without `answer_field` (file:line).
        ModelLoadError: no model at `model`.
        EngineError: the engine did not start or answer.
    """
    check_input_file("--data", data)
    model = resolve_model_dir(model)
    reward_fn = resolve_callable(reward)
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, model)
    longest, why = await trio.to_thread.run_sync(prompt_limit, model, max_new_tokens)
    prompts, _ = await trio.to_thread.run_sync(lambda: load_prompt_file(
        data, tokenizer, max_prompt_len=longest, overlong=overlong, limit=limit,
        limit_why=why))  # fmt: skip
    check_scorable(prompts, answer_field)
    shown: dict[int, Sample] = {}

    def keep(i: int, sample: Sample) -> None:
        if i < show:
            shown[i] = sample

    async with open_model_engine(model, engine_url) as engine:
        metrics = await evaluate_greedy(engine, prompts, reward_fn, max_new_tokens=max_new_tokens,
                                        tokenizer=tokenizer, on_scored=keep)  # fmt: skip
    blocks = [format_sample(i, prompts[i], shown.get(i), tokenizer, expected_key=answer_field,
                            scored=True) for i in range(min(show, len(prompts)))]  # fmt: skip
    return {**metrics, "n_prompts": float(len(prompts))}, blocks
