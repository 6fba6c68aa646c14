"""`rollouts generate` and `rollouts eval --show`: a model's answers, printed for a person.

A model is looked at through the same engine path as `rollouts eval`: a local engine launched
on it for the purpose (stopped at the end), or a live server given by `--engine-url`. `--model`
is any form `plumbing.model_paths.resolve_model_dir` takes (a model, run, checkpoints or
checkpoint directory). Input is any file `rollouts sft` or `rollouts rl` reads
(training/recipes/prompt_files.py): a chat's messages before its last assistant turn are the
prompt (tools rendered by the chat template), that turn (or `completion`, or `answer`) is what
is printed as expected. A prompt too long for the model's context with `--max-new-tokens` is
skipped (or cut: `--overlong truncate`) with a warning naming its line; nothing is scored or
trained; sampling is greedy unless asked.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio

from plumbing.errors import EngineError
from plumbing.model_paths import resolve_model_dir
from rollouts.generation import GenerateContext, single_turn_generate
from rollouts.prompts import PromptItem
from rollouts.types import Sample

EXPECTED = "expected"  # metadata key: the reference answer a chat or prompts file carries
log = logging.getLogger("rollouts.generate")


def prompt_limit(model: str, max_new_tokens: int) -> tuple[int | None, str]:
    """(the longest prompt `model` can answer with `max_new_tokens` new tokens, what it is),
    or (None, "") when the model's context is unknown.

    The engine refuses a request whose prompt plus `max_new_tokens` reaches the context
    (SGLang's rule, which the local engine follows), so the limit leaves room for them.
    """
    from training.recipes.sft import model_context  # transformers: not for `--help`

    context = model_context(model)
    if context is None:
        return None, ""
    return max(1, context - max_new_tokens - 1), (
        f"the model's context of {context} tokens less --max-new-tokens {max_new_tokens}"
    )


@contextlib.asynccontextmanager
async def open_model_engine(model: str, engine_url: str | None) -> AsyncIterator[Any]:
    """An engine serving `model`: the live one at `engine_url` (probed first), or a local one
    launched on `model` and stopped when the block exits."""
    from engines.client import SGLangEngine, probe_engines
    from engines.launch import launch_engine

    async with contextlib.AsyncExitStack() as stack:
        url = engine_url
        if url is None:
            launched = await stack.enter_async_context(launch_engine(
                kind="local", model_path=model, extra_args=["--num-threads", "1"],
                startup_timeout_s=300))  # fmt: skip
            url = launched.url
        else:
            await probe_engines([url])
        yield await stack.enter_async_context(SGLangEngine(url))


async def generate_answers(engine: Any, prompts: Sequence[PromptItem], *, max_new_tokens: int,
                           temperature: float = 0.0, max_concurrency: int = 16
                           ) -> list[Sample | None]:  # fmt: skip
    """One answer per prompt, in prompt order (None where the engine refused that prompt,
    HTTP 400, e.g. a prompt too long for a served model with a shorter context: a WARNING
    names its record).

    Raises:
        EngineError: any other engine failure (a person asked for every answer).
    """
    limiter = trio.CapacityLimiter(max_concurrency)
    params = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    out: list[Sample | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        ctx = GenerateContext(engine, params, limiter, f"generate-{i}", i)
        try:
            samples = await single_turn_generate(prompts[i], 1, ctx)
        except EngineError as err:
            if err.status != 400:  # the engine's failure, not this record's
                raise
            log.warning("%s: the engine refused this prompt: %s", prompts[i].source, err)
            return
        out[i] = samples[0] if samples else None

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


def format_sample(index: int, prompt: PromptItem, sample: Sample | None, tokenizer: Any, *,
                  expected_key: str = EXPECTED, scored: bool = False) -> str:  # fmt: skip
    """A few readable lines: the prompt's last turn, the model's answer, the expected answer
    and (`scored`) the reward."""
    turn = prompt.messages[-1]
    if sample is None:
        answer = "<no answer: the engine failed this prompt>"
    else:
        answer = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    lines = [f"--- {index + 1}: {prompt.source}", f"prompt:   {turn['content']}",
             f"answer:   {answer}"]  # fmt: skip
    if expected_key in prompt.metadata:
        lines.append(f"expected: {prompt.metadata[expected_key]}")
    if scored and sample is not None:
        parts = "".join(f" {k}={v:.4g}" for k, v in sample.reward_components.items())
        error = f" ({sample.error})" if sample.status == "failed" else ""
        lines.append(f"score:    reward={sample.reward:.4g}{parts}{error}")
    return "\n".join(lines)


async def run_generate(args: argparse.Namespace) -> list[str]:
    """The printed blocks of `rollouts generate`, one per prompt answered."""
    from training.backend.model_io import load_tokenizer
    from training.recipes.prompt_files import load_prompt_file
    from training.recipes.sft import check_input_file

    check_input_file("--data", args.data)
    model = resolve_model_dir(args.model)
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, model)
    limit, why = await trio.to_thread.run_sync(prompt_limit, model, args.max_new_tokens)
    prompts, _ = await trio.to_thread.run_sync(lambda: load_prompt_file(
        args.data, tokenizer, max_prompt_len=limit, overlong=args.overlong, limit=args.limit,
        expected_key=EXPECTED, limit_why=why))  # fmt: skip
    async with open_model_engine(model, args.engine_url) as engine:
        samples = await generate_answers(engine, prompts, max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature)  # fmt: skip
    return [format_sample(i, p, s, tokenizer) for i, (p, s) in enumerate(zip(prompts, samples,
                                                                            strict=True))]  # fmt: skip


def generate_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """`rollouts generate`: print a model's answer to each prompt of a prompts or chat file.

    Returns the exit code: 0, 2 after printing the errors, 130 after an interrupt.
    """
    from training.loops.loggers import setup_logging
    from training.recipes.cli_run import run_without_run_dir

    parser = argparse.ArgumentParser(prog=prog, description=(
        "Print a model's answers to a prompts file or a chat JSONL file (the conversation "
        "before its last assistant turn is the prompt; the reference answer, if any, is printed beside "
        "the model's), through a local engine launched for the purpose (or --engine-url)."))  # fmt: skip
    parser.add_argument("--model", required=True,
                        help="HF model directory, run directory, its checkpoints/ or a checkpoint")  # fmt: skip
    parser.add_argument("--data", required=True, help='any JSONL rollouts sft or rl reads: '
                        '{"messages" (tools, tool calls) or "prompt", optional "answer"/"completion"}')  # fmt: skip
    parser.add_argument("--overlong", choices=("drop", "truncate"), default="drop",
                        help="a prompt too long for the context: skip it (default), or keep its "
                             "last tokens")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts")
    parser.add_argument("--engine-url", default=None, help="a live server (default: launch one)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    code, blocks = run_without_run_dir(lambda: run_generate(args))
    if code == 0:
        print("\n".join(blocks))
    return code
