"""UnservedGroups: the prompts a rollout manager took from its DataBuffer that no batch served yet.

A checkpoint stores the DataBuffer's cursor and holding area. A prompt taken from the buffer but
neither trained nor held back is past the cursor and in no holding area, so a resume from that
checkpoint would never train it: in "async" mode the producer's collection in progress (held
groups it took again included) and the batches waiting in its channel, in "overlap" mode the
batch being prefetched. The manager notes each prompt it draws (`drawn`), the groups each
finished collection accepted (`collected`; its cut-short groups are back in the holding area by
then) and the groups that left it (`served`: returned in a batch, or held or dropped as stale by
the consumer). `records()` is what is still owed, as holding-area records, and
`AsyncRolloutManager.data_state()` puts them in the buffer's state_dict, first.

Guarantee: at a checkpoint, every prompt drawn from the buffer is trained by a step up to it,
held in its state, or was counted as dropped (a failed or filtered group, a stale group under
`stale_policy: drop`). An accepted group keeps its samples (a resume reuses those still within
`max_staleness`); a prompt of a collection in progress keeps only the samples it was drawn with
(its group is generated again on resume). The record of a served batch's group is gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollouts.prompts import PromptItem
from rollouts.types import Sample


class UnservedGroups:
    """See the module docstring. One collection runs at a time (every mode)."""

    def __init__(self) -> None:
        self._collecting: list[tuple[PromptItem, list[Sample]]] = []
        self._collected: list[tuple[PromptItem, tuple[Sample, ...]]] = []

    def drawn(self, prompt: PromptItem, samples: Sequence[Sample]) -> None:
        self._collecting.append((prompt, list(samples)))

    def collected(self, accepted: Sequence[tuple[Sample, ...]]) -> None:
        """A collection finished: its accepted groups are owed (with the prompts as drawn,
        messages included, for an agent's resume), the rest is settled."""
        prompts = {p.prompt_ids: p for p, _ in self._collecting}
        self._collecting.clear()
        self._collected.extend((prompts.get(g[0].prompt_ids) or prompt_of(g), g) for g in accepted)

    def abandoned(self) -> list[tuple[PromptItem, list[Sample]]]:
        """The collection in progress was cancelled: its prompts, with the samples they were
        drawn with, for the caller to hold back (none of it was served)."""
        drawn, self._collecting = self._collecting, []
        return drawn

    def served(self, groups: Sequence[tuple[Sample, ...]] | None = None
               ) -> dict[int, PromptItem]:  # fmt: skip
        """These accepted groups (None: every one) left the manager; their prompts as drawn
        (messages and source included), by `id(group)`, for a caller that holds one again."""
        if groups is None:
            self._collected.clear()
            return {}
        gone = {id(g) for g in groups}
        prompts = {id(g): p for p, g in self._collected if id(g) in gone}
        self._collected = [(p, g) for p, g in self._collected if id(g) not in gone]
        return prompts

    def records(self) -> list[dict[str, Any]]:
        """Holding-area records (`held_record`) of every group still owed, oldest first."""
        return [*(held_record(p, list(g)) for p, g in self._collected),
                *(held_record(p, s) for p, s in self._collecting)]  # fmt: skip


def held_record(prompt: PromptItem, samples: list[Sample]) -> dict[str, Any]:
    """A DataBuffer holding-area item: a prompt and the samples it already has."""
    return {"prompt": prompt.to_dict(), "samples": [s.to_dict() for s in samples]}


def prompt_of(group: Sequence[Sample]) -> PromptItem:
    """The prompt of a finished group (its token ids and metadata; no messages): only where
    the prompt as drawn is gone (an agent's or environment's episode needs its messages)."""
    s = group[0]
    return PromptItem(s.prompt_ids, (), s.metadata, "")
