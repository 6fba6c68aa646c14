"""`rollouts eval`: greedy held-out accuracy of a model (or checkpoint) through an engine.

The engine is a local one launched on the model for the purpose (stopped at the end), or a
live server given by URL (probed once first). Prompts are RL-format JSONL (`messages` or
`prompt`, plus the ground truth the reward reads, e.g. `answer`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import trio

from engines.client import SGLangEngine, probe_engines
from engines.launch import launch_engine
from rollouts.evaluation import evaluate_greedy
from rollouts.prompts import load_prompt_jsonl
from training.backend.checkpoint import resolve_checkpoint
from training.backend.model_io import check_model_path, load_tokenizer
from training.recipes.rl import resolve_callable
from training.recipes.sft import check_input_file


def model_directory(model: str) -> str:
    """`model`, or the checkpoint its `latest` file names when it is a checkpoints directory."""
    if (Path(model) / "latest").is_file():
        return str(resolve_checkpoint(model))
    return model


async def evaluate_model(model: str, data: str, reward: str, *, max_new_tokens: int = 16,
                         limit: int | None = None, engine_url: str | None = None
                         ) -> dict[str, float]:  # fmt: skip
    """One greedy episode per prompt, scored by `reward` (`module:function`).

    Returns:
        `accuracy`, `reward_mean` (and tool metrics for tool episodes), plus `n_prompts`.

    Raises:
        ConfigError: a missing data file or unresolvable reward.
        ModelLoadError: no model at `model`.
        EngineError: the engine did not start or answer.
    """
    check_input_file("--data", data)
    model = model_directory(model)
    check_model_path(model)
    reward_fn = resolve_callable(reward)
    if engine_url is not None:
        await probe_engines([engine_url])
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, model)
    prompts = await trio.to_thread.run_sync(load_prompt_jsonl, data, tokenizer)
    prompts = prompts[:limit]
    async with contextlib.AsyncExitStack() as stack:
        url = engine_url
        if url is None:
            launched = await stack.enter_async_context(launch_engine(
                kind="local", model_path=model, extra_args=["--num-threads", "1"],
                startup_timeout_s=300))  # fmt: skip
            url = launched.url
        engine = await stack.enter_async_context(SGLangEngine(url))
        metrics = await evaluate_greedy(engine, prompts, reward_fn, max_new_tokens=max_new_tokens,
                                        tokenizer=tokenizer)  # fmt: skip
    return {**metrics, "n_prompts": float(len(prompts))}
