"""What the viewer shows of a run directory, as plain JSON-ready dicts (no HTML here).

A run directory (docs/rl.md, docs/sft.md) holds `metrics.jsonl` (one row per step),
`rollouts.jsonl` (RL with `train.dump_rollouts: true`: one `{"step": N, **RolloutBatch}` line
per step, appended; a step that ran twice keeps its last line), `eval_generations.jsonl` (SFT:
the held-out greedy answers of each evaluation), `config.yaml` and `checkpoints/`.

What is covered: per step, every group with its prompt, each sample's response (as tokens with
their engine logprobs and loss-mask bits), reward and components, advantage, finish reason,
status and error, weight version, staleness, tool calls, and agent branches (`sub_index` > 0).
Advantages are recomputed from the rewards with the algorithm the run's `config.yaml` names for
that step (the estimator is a pure function of the group's rewards). What is not covered: an
`advantage_fn` passed in code (the viewer cannot know it; the column then shows the
configured estimator's values), GAE (PPO: per token, from the critic; shown as none), and a KL
penalty folded into rewards (`kl_as_reward`: the dump holds the rewards before it).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from plumbing.errors import DataError
from rollouts.types import RolloutBatch, Sample, ToolCallRecord

DUMP = "rollouts.jsonl"
METRICS = "metrics.jsonl"
SFT_EVALS = "eval_generations.jsonl"

Decode = Callable[[list[int]], str]


def finite(value: Any) -> Any:
    """JSON-safe: NaN and infinities become None (JS would read them as identifiers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of `metrics.jsonl` with numeric values only; a torn last line is skipped."""
    path = run_dir / METRICS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line being written as we read (a live run)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append({k: finite(v) for k, v in row.items()
                         if isinstance(v, int | float) and not isinstance(v, bool)})  # fmt: skip
    return rows


def iter_new_dump_lines(path: Path, offset: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(end offset, step, record) of each complete line after byte `offset` of a dump.

    A line not yet ended by a newline (being written) is left for the next call.

    Raises:
        DataError: a complete line is not a dump record (names the file and byte offset).
    """
    with path.open("rb") as file:
        file.seek(offset)
        for raw in file:
            if not raw.endswith(b"\n"):
                return
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                step = record.pop("step")
                if not isinstance(step, int):
                    raise TypeError("step is not an integer")
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise DataError(f"{path}: the line at byte {start} is not a rollout dump record "
                                f"({err}); the file must be written by RolloutDumpWriter "
                                "(train.dump_rollouts=true)") from err  # fmt: skip
            yield offset, step, record


def prompt_key(prompt_ids: tuple[int, ...]) -> str:
    """A short stable name of a prompt (its token ids): the same prompt across steps."""
    return hashlib.sha1(json.dumps(list(prompt_ids)).encode()).hexdigest()[:12]


def token_decoder(decode: Decode | None) -> Callable[[int], str]:
    """Each token's text, cached (a vocabulary is decoded once, not once per occurrence)."""
    cache: dict[int, str] = {}

    def one(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = decode([token_id]) if decode is not None else f"⟨{token_id}⟩"
        return cache[token_id]

    return one


def tool_view(call: ToolCallRecord) -> dict[str, Any]:
    return {"name": call.name, "args": json.dumps(dict(call.arguments), ensure_ascii=False),
            "out": call.output, "ok": call.success, "s": round(call.latency_s, 4),
            "err": call.error}  # fmt: skip


def sample_view(sample: Sample, step: int, advantage: float | None, token: Callable[[int], str],
                trainer_logprobs: list[float] | None) -> dict[str, Any]:  # fmt: skip
    """One sample as the page reads it (short keys: a step file holds thousands)."""
    out = {
        "i": sample.index_in_group,
        "sub": sample.sub_index,
        "status": sample.status,
        "finish": sample.finish_reason,
        "reward": finite(sample.reward),
        "comps": {k: finite(v) for k, v in sample.reward_components.items()},
        "adv": None if advantage is None else finite(round(advantage, 6)),
        "wv": sample.weight_version,
        "stale": step - 1 - sample.weight_version,
        "err": sample.error,
        "text": sample.response_text,
        "toks": [token(t) for t in sample.response_ids],
        "ids": list(sample.response_ids),
        "mask": list(sample.loss_mask),
        "lp": [finite(x) for x in sample.rollout_logprobs],
        "tools": [tool_view(t) for t in sample.tool_calls],
    }
    if trainer_logprobs is not None:
        out["tlp"] = [finite(x) for x in trainer_logprobs]
    return out


def step_view(step: int, record: dict[str, Any], decode: Decode | None,
              advantages: Callable[[int, RolloutBatch], list[list[float | None]]] | None,
              token: Callable[[int], str]) -> dict[str, Any]:  # fmt: skip
    """A dump line as the page's step data: groups of samples, and the step's rollout metrics.

    `record` may carry `trainer_logprobs` (group-major lists, one per sample: the trainer's
    logprobs of the same tokens), shown as the engine/trainer mismatch colouring.

    Raises:
        DataError: the record is not a valid batch.
    """
    record = dict(record)
    trainer = record.pop("trainer_logprobs", None)
    batch = RolloutBatch.from_dict(record)
    adv_GN = advantages(step, batch) if advantages is not None else None
    groups, k = [], 0
    for g, group in enumerate(batch.groups):
        first = group[0]
        samples = []
        for n, sample in enumerate(group):
            adv = adv_GN[g][n] if adv_GN is not None else None
            tlp = trainer[k] if trainer is not None and k < len(trainer) else None
            samples.append(sample_view(sample, step, adv, token, tlp))
            k += 1
        prompt = decode(list(first.prompt_ids)) if decode is not None else ""
        groups.append({"g": g, "gid": first.group_id, "key": prompt_key(first.prompt_ids),
                       "prompt": prompt, "meta": json.dumps(dict(first.metadata),
                                                             ensure_ascii=False, default=str),
                       "samples": samples})  # fmt: skip
    return {"step": step, "epoch": batch.epoch_id,
            "metrics": {k: finite(v) for k, v in batch.metrics.items()},
            "failures": dict(batch.failures), "groups": groups}  # fmt: skip


def step_summary(view: dict[str, Any]) -> dict[str, Any]:
    """What the manifest says of a step without its file: counts the step list and filters use."""
    samples = [s for g in view["groups"] for s in g["samples"]]
    rewards = [s["reward"] for s in samples if s["reward"] is not None]
    return {
        "step": view["step"], "groups": len(view["groups"]), "samples": len(samples),
        "reward": sum(rewards) / len(rewards) if rewards else None,
        "failed": sum(s["status"] == "failed" for s in samples),
        "truncated": sum(s["status"] == "truncated" for s in samples),
        "tools": sum(len(s["tools"]) for s in samples),
        "stale_max": max((s["stale"] for s in samples), default=0),
        "prompts": [g["key"] for g in view["groups"]],
    }  # fmt: skip


def read_sft_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The SFT run's held-out generations, one record per prompt per evaluation."""
    path = run_dir / SFT_EVALS
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
