"""`rollouts generate` and `rollouts eval --show`: a model's answers, printed for a person.

A model is looked at through the same engine path as `rollouts eval`: a local engine launched
on it for the purpose (stopped at the end), or a live server given by `--engine-url`. Input is
a prompts file (`messages` or `prompt`, optional `answer`) or a chat file as SFT reads it
(`messages` ending with the assistant's turn, or `prompt` + `completion`): the conversation up
to the last user turn is the prompt, the turn after it (or `completion`, or `answer`) is what
is printed as expected. Nothing is scored or trained; sampling is greedy unless asked.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from rollouts.generation import GenerateContext, single_turn_generate
from rollouts.prompts import PromptItem, checked_prompts, encode_prompt, iter_prompt_records
from rollouts.types import Sample

EXPECTED = "expected"  # metadata key: the reference answer a chat or prompts file carries


def model_directory(model: str) -> str:
    """`model`, or the checkpoint its `latest` file names when it is a checkpoints directory."""
    from training.backend.checkpoint import resolve_checkpoint  # torch: not for `--help`
    from training.backend.lora import loadable_model_dir

    if (Path(model) / "latest").is_file():
        return str(loadable_model_dir(resolve_checkpoint(model)))
    if Path(model).is_dir():  # a LoRA checkpoint: its merged model
        return str(loadable_model_dir(Path(model)))
    return model


def split_reference(messages: list[dict], obj: Mapping[str, Any]) -> tuple[list[dict], Any]:
    """(prompt messages, expected answer): a chat's turns after its last user turn are cut
    off, and the last of them is the reference; else the record's `answer` or `completion`."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is not None and last_user + 1 < len(messages):
        return messages[: last_user + 1], messages[-1]["content"]
    return messages, obj.get("answer", obj.get("completion"))


def load_generation_prompts(path: str | Path, tokenizer: Any, *, limit: int | None = None
                            ) -> list[PromptItem]:  # fmt: skip
    """Prompts to answer, from a prompts or chat JSONL (see the module docstring).

    Raises:
        DataError: malformed lines (file:line:field, all collected), or no prompts at all.
    """
    errors: list[str] = []
    items: list[PromptItem] = []
    for source, obj, messages in iter_prompt_records(path, errors):
        messages, expected = split_reference(messages, obj)
        metadata = {k: v for k, v in obj.items() if k not in ("messages", "prompt", "completion")}
        if expected is not None:
            metadata[EXPECTED] = expected
        ids = encode_prompt(tokenizer, messages, obj.get("tools"))
        items.append(PromptItem(tuple(ids), tuple(messages), metadata, source))
        if limit is not None and len(items) >= limit:
            break
    return checked_prompts(path, errors, items)


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
    """One answer per prompt, in prompt order (None where the engine failed it).

    Raises:
        EngineError: an engine failure (a person asked for every answer: none is skipped).
    """
    limiter = trio.CapacityLimiter(max_concurrency)
    params = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    out: list[Sample | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        ctx = GenerateContext(engine, params, limiter, f"generate-{i}", i)
        samples = await single_turn_generate(prompts[i], 1, ctx)
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
    """The printed blocks of `rollouts generate`, one per prompt."""
    from training.backend.model_io import check_model_path, load_tokenizer
    from training.recipes.sft import check_input_file

    check_input_file("--data", args.data)
    model = model_directory(args.model)
    check_model_path(model)
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, model)
    prompts = await trio.to_thread.run_sync(
        lambda: load_generation_prompts(args.data, tokenizer, limit=args.limit)
    )
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
        "Print a model's answers to a prompts file or a chat JSONL file (the conversation up "
        "to its last user turn is the prompt; the reference answer, if any, is printed beside "
        "the model's), through a local engine launched for the purpose (or --engine-url)."))  # fmt: skip
    parser.add_argument("--model", required=True, help="HF model or checkpoint directory")
    parser.add_argument("--data", required=True,
                        help='JSONL: {"messages" or "prompt", optional "answer"/"completion"}')  # fmt: skip
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
