"""What a rollout dump says about the samples a run sent and trained: lost, trained twice, stale.

`audit_rollout_dump(path, max_lag=..., drawn=..., held=...)` reads every line of a dump written
by `RolloutDumpWriter` (a resumed run appends to the same file) and counts, over the run's
surviving lineage of steps:

- lineage: the dump's lines in order, where a line for step s that is not after the last kept
  step (a resume from an earlier checkpoint redid it) discards the kept lines of steps >= s, as
  the resumed trainer discarded their updates. `rerun_steps` counts the lines so discarded.
- trained: the samples of the kept lines (every sample of a step's batch is in its update;
  agent branches, `sub_index` > 0, are left out of this count).
- lost: prompts sent (`drawn`: the prompts the run took from its data, in the order it took
  them, e.g. `DataBuffer.get_prompts(n)` for the final checkpoint's cursor) up to the last one
  that was trained or is still held at the end (`held`: the final checkpoint's held groups), that
  were neither trained, held, nor accounted as dropped (`groups_failed` + `groups_filtered` of
  the kept lines), times the group size. Prompts drawn after that last one were in flight when
  the run ended and are not counted. With `held` from the final checkpoint this is what a resume
  from it would never train. The dump does not name the prompts of failed groups, so every
  failed or filtered group of the lineage is subtracted, also one drawn after the cut-off of
  `drawn` (it then hides one lost group; `lost` is never negative).
- twice: extra occurrences of a sample identity among the trained samples: the same generation
  (prompt tokens, index and sub-index in its group, response tokens, engine logprobs) trained
  in two steps (or twice in one).
- stale: trained samples whose `weight_version` is below step - 1 - `max_lag` (step s trains on
  samples of the weights after step s - 1, or up to `max_lag` versions older: 0 in sync mode,
  1 in overlap mode, `rollout.max_staleness` in async mode).

Prompts are told apart by their token ids, so a prompt that occurs twice in the data counts as
trained for both occurrences.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from plumbing.errors import DataError
from rollouts.types import RolloutBatch, Sample

ROLLOUT_MODE_LAG = {"sync": 0, "overlap": 1}  # async: rollout.max_staleness


@dataclass(frozen=True)
class DumpAudit:
    steps: int  # the last step of the lineage (0 if none)
    rerun_steps: int
    trained: int
    dropped: int  # samples of failed or filtered groups
    lost: int
    twice: int
    stale: int


def sample_identity(sample: Sample) -> tuple:
    """One generation: equal only for the same engine answer (logprobs included)."""
    return (sample.prompt_ids, sample.index_in_group, sample.sub_index, sample.response_ids,
            tuple(sample.rollout_logprobs))  # fmt: skip


def read_dump_lines(path: str | Path) -> list[tuple[int, RolloutBatch]]:
    """Every line of a dump, in order, repeated steps included.

    Raises:
        DataError: a line is not a `{"step": N, **batch}` record (names the file and line).
    """
    lines = []
    for number, text in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
            step = obj.pop("step")
            lines.append((int(step), RolloutBatch.from_dict(obj)))
        except (ValueError, KeyError, TypeError, AttributeError, DataError) as err:
            raise DataError(f"{path}:{number}: not a rollout dump record ({err}); the file must "
                            "be written by RolloutDumpWriter (train.dump_rollouts=true)") from err  # fmt: skip
    return lines


def audit_rollout_dump(path: str | Path, *, max_lag: int, drawn: Sequence[Sequence[int]],
                       held: Iterable[Sequence[int]] = ()) -> DumpAudit:  # fmt: skip
    """See the module docstring: `drawn` and `held` are prompts' token ids. Raises DataError
    for a malformed dump."""
    kept: list[tuple[int, RolloutBatch]] = []
    rerun = 0
    for step, batch in read_dump_lines(path):
        while kept and kept[-1][0] >= step:
            kept.pop()
            rerun += 1
        kept.append((step, batch))
    trained = dropped_groups = stale = 0
    size = 1
    seen: Counter[tuple] = Counter()
    done = {tuple(p) for p in held}
    for step, batch in kept:
        size = max([size, *(sum(1 for s in g if s.sub_index == 0) for g in batch.groups)])
        dropped_groups += round(batch.metrics.get("groups_filtered", 0)
                                + batch.metrics.get("groups_failed", 0))  # fmt: skip
        samples = batch.samples
        trained += sum(1 for s in samples if s.sub_index == 0)
        stale += sum(1 for s in samples if s.weight_version < step - 1 - max_lag)
        seen.update(sample_identity(s) for s in samples)
        done.update(s.prompt_ids for s in samples)
    drawn = [tuple(p) for p in drawn]
    last = max((i for i, p in enumerate(drawn) if p in done), default=-1)
    missing = sum(1 for p in drawn[: last + 1] if p not in done)
    return DumpAudit(steps=kept[-1][0] if kept else 0, rerun_steps=rerun, trained=trained,
                     dropped=dropped_groups * size, lost=max(0, missing - dropped_groups) * size,
                     twice=sum(n - 1 for n in seen.values()), stale=stale)  # fmt: skip
