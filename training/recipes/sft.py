"""Recipe glue: turn a validated run config into components and run the SFT loop.

Examples call these so that they stay short; everything here is plain wiring of the public
pieces (tiny model, data loading, tokenization, backend, loop, loggers), so a user who wants a
different wiring copies the few lines they need.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import trio

from plumbing.errors import ConfigError
from plumbing.model_paths import resolve_model_dir
from rollouts.tasks.arithmetic import is_correct
from rollouts.thinking import thinking_template_kwargs
from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
from training.backend.tiny_model import ensure_tiny_model
from training.config import DEFAULT_PACK_LENGTH, ModelConfig, SFTRunConfig, config_to_yaml
from training.data.accounting import issues_warning, write_data_report
from training.data.buffer import DataBuffer
from training.data.sft_data import load_sft_jsonl
from training.data.tokenize import TokenizeStats, tokenize_records
from training.loops.evaluate import EvalPrompt, greedy_accuracy, write_generations
from training.loops.hooks import SFTHooks
from training.loops.loggers import (
    ConsoleLogger,
    JsonlLogger,
    Logger,
    check_logger_extras,
    config_loggers,
    fan_out,
)
from training.loops.run_length import sft_run_length
from training.loops.sft import SFTData, run_sft_training

log = logging.getLogger("rollouts.recipes")


def resolve_model_path(config: ModelConfig) -> str:
    """The model to load: the HF model directory `config.path` names (a run or checkpoints
    directory: its latest checkpoint), or the tiny local model (built on first use)."""
    if config.path is not None:
        return resolve_model_dir(config.path)
    return str(ensure_tiny_model(config.tiny_dir, seed=config.tiny_seed, size=config.tiny_size))


@dataclass(frozen=True)
class PreparedSFTData:
    data: SFTData
    stats: tuple[TokenizeStats, TokenizeStats]  # train, eval
    accuracy_prompts: tuple[EvalPrompt, ...]
    fingerprint: str  # of the files trained and evaluated on (see `sft_data_files`)
    lengths: SampleLengths


def load_eval_prompts(path: Path) -> tuple[EvalPrompt, ...]:
    """Prompts with ground-truth answers from an RL-format JSONL (`messages` + `answer`)."""
    prompts = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                prompts.append(EvalPrompt(tuple(obj["messages"]), str(obj["answer"])))
    return tuple(prompts)


@dataclass(frozen=True)
class SFTDataFiles:
    train: Path
    eval: Path | None
    accuracy: Path | None  # prompts + answers for the in-loop greedy check (single-turn tasks)

    def fingerprint(self) -> str:
        """sha256 over the files' bytes: tells whether a checkpoint was trained on this data."""
        h = hashlib.sha256()
        for path in (self.train, self.eval, self.accuracy):
            h.update(b"-" if path is None else path.read_bytes() + b"\0")
        return h.hexdigest()


def sft_data_files(config: SFTRunConfig) -> SFTDataFiles:
    """The JSONL files an SFT config trains on: its paths, or its task's (written if needed).

    Raises:
        ConfigError: `data.train_path` or `data.eval_path` names no file (checked here, before
            any model is loaded).
    """
    dc = config.data
    if dc.train_path is not None:
        eval_path = Path(dc.eval_path) if dc.eval_path else None
        check_input_file("data.train_path (--data)", dc.train_path)
        if eval_path is not None:
            check_input_file("data.eval_path (--eval-data)", eval_path)
        return SFTDataFiles(Path(dc.train_path), eval_path, None)
    files = dc.write_task_files()
    accuracy = files.rl_eval if dc.task == "arithmetic" else None  # single-turn: greedy check
    return SFTDataFiles(files.sft_train, files.sft_eval, accuracy)


def check_input_file(key: str, path: str | Path) -> None:
    """Raise ConfigError naming `key` when `path` is not a readable file."""
    p = Path(path)
    if not p.is_file():
        why = "is a directory, not a JSONL file" if p.is_dir() else "no such file"
        raise ConfigError(f"{key}: {path}: {why}")


def check_pack_length(config: SFTRunConfig, samples: list[Any], what: str,
                      lengths: SampleLengths) -> None:  # fmt: skip
    """Packed rows must hold every sample: fail before training, naming the keys to change.

    Raises:
        ConfigError: a sample is longer than the pack length (names the first, its length,
            and `data.max_seq_len`, the other way to make it fit).
    """
    if not config.data.packing:
        return
    too_long = [s for s in samples if len(s) > lengths.pack_length]
    if too_long:
        first = too_long[0]
        raise ConfigError(
            f"{what}: {len(too_long)} sample(s) are longer than data.pack_length="
            f"{lengths.pack_length} tokens, so they fit no packed row (e.g. {first.source}, "
            f"{len(first)} tokens): raise data.pack_length to at least data.max_seq_len="
            f"{lengths.max_seq_len} (or leave it null to follow data.max_seq_len), or lower "
            "data.max_seq_len"
        )


def data_report_path(config: SFTRunConfig) -> Path:
    """Where the run lists every record cut or dropped: `data.report_path`, or the output dir's."""
    return Path(config.data.report_path or Path(config.output_dir) / "data_report.jsonl")


def report_data_issues(config: SFTRunConfig, stats: Sequence[TokenizeStats]) -> None:
    """One WARNING naming the records cut or dropped (the first few), and the report of all."""
    issues = [issue for s in stats for issue in s.issues]
    path = write_data_report(data_report_path(config), issues)
    n_records = sum(s.n_records for s in stats)
    fix = ("raise data.max_seq_len to keep over-long records whole" if config.data.max_seq_len
           else "they are longer than the model's context (max_position_embeddings): shorten "
           "or split them")  # fmt: skip
    warning = issues_warning(issues, n_records, fix, path)
    if warning is not None:
        log.warning("%s", warning)


class SampleLengths(NamedTuple):
    """The lengths a run trains with: the config's, or (null there) the data's."""

    max_seq_len: int
    pack_length: int
    why: str  # where max_seq_len came from, for the log line


def model_context(model_path: str) -> int | None:
    """The model's context length (`max_position_embeddings` of its config), None if unknown."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None  # the model load that follows names the path and the cause
    return getattr(hf_config, "max_position_embeddings", None)


def resolve_lengths(config: SFTRunConfig, longest: int, context: int | None) -> SampleLengths:
    """`data.max_seq_len` and `data.pack_length`, filling a null from the longest record.

    A null `max_seq_len` becomes the longest tokenized record, capped by the model's context
    (a longer sample could not be trained on); a null `pack_length` follows it, and is never
    below `DEFAULT_PACK_LENGTH`, so short records still share rows.
    """
    dc = config.data
    if dc.max_seq_len is not None:
        max_seq_len, why = dc.max_seq_len, "from the config"
    elif context is not None and longest > context:
        max_seq_len, why = context, f"the model's context, max_position_embeddings={context}"
    else:
        max_seq_len, why = max(2, longest), "the longest record"
    pack_length = dc.pack_length or max(DEFAULT_PACK_LENGTH, max_seq_len)
    return SampleLengths(max_seq_len, pack_length, why)


def prepare_sft_data(config: SFTRunConfig, tokenizer: Any, *, context: int | None = None
                     ) -> PreparedSFTData:  # fmt: skip
    """Load (or generate) the SFT data, validate and tokenize it, and wrap it in a DataBuffer.

    Args:
        context: the model's context length; with `data.max_seq_len` null, samples are cut
            only beyond it (see `resolve_lengths`).

    Raises:
        DataError: any malformed record (all collected, before training starts).
        ConfigError: no data source configured; a sample longer than the pack length.
    """
    dc = config.data
    files = sft_data_files(config)
    accuracy_prompts: tuple[EvalPrompt, ...] = ()
    if files.accuracy is not None:
        accuracy_prompts = load_eval_prompts(files.accuracy)[: config.train.greedy_eval_samples]
    train_records = load_sft_jsonl(files.train)
    eval_records = load_sft_jsonl(files.eval) if files.eval else []
    limit = dc.max_seq_len or context or sys.maxsize
    kw = dict(max_seq_len=limit, overlong=dc.overlong,
              template_kwargs=thinking_template_kwargs(tokenizer, config.model.enable_thinking))  # fmt: skip
    train_samples, stats = tokenize_records(train_records, tokenizer, **kw)
    eval_samples, eval_stats = tokenize_records(eval_records[: config.train.eval_samples],
                                                tokenizer, **kw)  # fmt: skip
    lengths = resolve_lengths(config, max(stats.longest, eval_stats.longest), context)
    log.info("train data %s: %s", files.train, stats.summary())
    log.info("data.max_seq_len=%d (%s), data.pack_length=%d", lengths.max_seq_len, lengths.why,
             lengths.pack_length)  # fmt: skip
    if eval_samples:
        log.info("eval data %s: %s", files.eval, eval_stats.summary())
    check_pack_length(config, train_samples, str(files.train), lengths)
    check_pack_length(config, eval_samples, str(files.eval), lengths)
    buffer = DataBuffer(train_samples, seed=dc.shuffle_seed)
    data = SFTData(buffer, tuple(eval_samples))
    return PreparedSFTData(data, (stats, eval_stats), accuracy_prompts, files.fingerprint(),
                           lengths)  # fmt: skip


def build_backend(config: SFTRunConfig, model_path: str, *, tokenizer: Any = None,
                  pack_length: int | None = None, max_steps: int | None = None
                  ) -> PyTorchTrainingBackend:  # fmt: skip
    """Load the model and tokenizer and wrap them in a backend configured by `config`.

    Args:
        tokenizer: the model's tokenizer if already loaded (else loaded from `model_path`).
        pack_length: tokens per packed row (`SampleLengths.pack_length`); None: the config's
            `data.pack_length`, or its default when that is null.
        max_steps: the run's length (`sft_run_length`), the LR schedule's horizon; None: the
            config's `train.max_steps`.
    """
    pack = pack_length or config.data.pack_length or DEFAULT_PACK_LENGTH
    return PyTorchTrainingBackend(
        partial(
            load_model,
            model_path,
            dtype=config.model.dtype,
            device=config.backend.device,
            attention=config.model.attention,
        ),
        tokenizer if tokenizer is not None else load_tokenizer(model_path),
        optim=config.optim,
        max_steps=max_steps or config.train.max_steps,
        checkpoint_dir=Path(config.output_dir) / "checkpoints",
        micro_batch_tokens=config.backend.micro_batch_tokens,
        pack_length=pack if config.data.packing else None,
        keep_last=config.train.keep_last,
        num_threads=config.backend.num_threads,
        seed=config.backend.seed,
        lora=config.model.lora,
    )


@dataclass(frozen=True)
class SFTSummary:
    steps: int
    final_loss: float | None
    eval_loss: float | None
    accuracy: float | None
    wall_time_s: float
    checkpoint: Path | None

    def line(self) -> str:
        def fmt(v: float | None, spec: str) -> str:
            return "n/a" if v is None else format(v, spec)

        return (
            f"SFT done: steps={self.steps} final_loss={fmt(self.final_loss, '.4f')} "
            f"eval_loss={fmt(self.eval_loss, '.4f')} "
            f"heldout_greedy_accuracy={fmt(self.accuracy, '.1%')} "
            f"wall_time={self.wall_time_s:.1f}s checkpoint={self.checkpoint}"
        )


async def run_sft_recipe(config: SFTRunConfig, *, on_step: Logger | None = None) -> SFTSummary:
    """Everything `examples/run_sft.py` does: model, data, backend, loop, loggers, summary.

    Input paths and lengths are checked before the model loads; the blocking set-up (writing
    task data, loading the model, tokenizing) runs in a worker thread, so a host app's other
    tasks keep running.

    Args:
        on_step: an extra logger called after every step (e.g. a host app watching progress).
    """
    t0 = time.perf_counter()
    await trio.to_thread.run_sync(sft_data_files, config)  # missing files fail here, at once
    check_logger_extras(config.logging)  # and a logger without its package
    model_path = await trio.to_thread.run_sync(resolve_model_path, config.model)
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, model_path)
    context = await trio.to_thread.run_sync(model_context, model_path)
    prepared = await trio.to_thread.run_sync(
        partial(prepare_sft_data, config, tokenizer, context=context)
    )
    out = Path(config.output_dir)  # created only once the config and the data are valid
    out.mkdir(parents=True, exist_ok=True)
    report_data_issues(config, prepared.stats)
    length = sft_run_length(config.train, len(prepared.data.train))
    resolved = config.model_dump(mode="json")
    (out / "config.yaml").write_text(config_to_yaml(config), encoding="utf-8")
    log.debug("resolved config:\n%s", config_to_yaml(config))

    backend = await trio.to_thread.run_sync(partial(
        build_backend, config, model_path, tokenizer=tokenizer,
        pack_length=prepared.lengths.pack_length, max_steps=length.steps))  # fmt: skip
    with backend:

        async def accuracy(b: PyTorchTrainingBackend) -> dict[str, float]:
            def record(rows: list[dict]) -> None:  # for `rollouts view` (training/viewer)
                write_generations(out / "eval_generations.jsonl", b.step, rows)

            return await greedy_accuracy(b, prepared.accuracy_prompts, is_correct,
                                         generations=record)  # fmt: skip

        if config.train.resume == "never":
            (out / "metrics.jsonl").unlink(missing_ok=True)
            (out / "eval_generations.jsonl").unlink(missing_ok=True)
        jsonl = JsonlLogger(out / "metrics.jsonl")
        console = ConsoleLogger(length.steps, every=config.train.log_every,
                                max_wall_s=config.train.max_wall_s)  # fmt: skip
        loggers = [jsonl, console, *config_loggers(config.logging, out, resolved)]
        try:
            history = await run_sft_training(
                backend,
                prepared.data,
                config.train,
                hooks=SFTHooks(
                    logger=fan_out(*loggers, *([on_step] if on_step else [])),
                    evaluate_fn=accuracy if prepared.accuracy_prompts else None,
                ),
                resolved_config=resolved,
                # the config is saved as given (a null length stays null, so the same config
                # matches this checkpoint again, see recipes/rl.py); the lengths it got beside it
                extra_state={
                    "data_sha256": prepared.fingerprint,
                    "data_lengths": prepared.lengths._asdict(),
                    "max_steps": length.steps,  # with train.max_steps null: from the epochs
                },
            )
        finally:
            for logger in loggers:
                logger.close()
        last = history[-1] if history else {}
        if not history:  # resumed a finished run: measure the final state again
            last = {**(await backend.forward(prepared.data.eval_samples).result())}
            last = {"eval_loss": last["loss"]}
            if prepared.accuracy_prompts:
                last.update(await accuracy(backend))
        from training.backend.checkpoint import find_latest_checkpoint

        return SFTSummary(
            steps=backend.step,
            final_loss=last.get("loss"),
            eval_loss=last.get("eval_loss"),
            accuracy=last.get("accuracy"),
            wall_time_s=time.perf_counter() - t0,
            checkpoint=find_latest_checkpoint(backend.checkpoint_dir),
        )
