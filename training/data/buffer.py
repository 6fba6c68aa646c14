"""DataBuffer: the prompt/sample source of a run, with resumable cursor state.

Guarantees:
- Deterministic order: epoch `e` visits every record once, in a permutation seeded by
  `(seed, e)`; the same seed gives the same order on every machine.
- `get_prompts(n)` returns exactly `n` records, rolling over into the next epoch when the
  current one runs out (an epoch boundary may fall inside one call).
- A holding area of items to serve before fresh prompts (RL: leftover groups from over-sampling,
  partial rollouts aborted at a weight update), each tagged with the weight version it came from.
- `state_dict()` / `load_state_dict()` capture the cursor and the holding area, so a resumed run
  neither repeats nor skips data.

Not covered: the records themselves are not part of the state (they are the dataset, passed in
again on resume); held items must be JSON-serialisable to be checkpointed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class HeldItem:
    """An item waiting in the holding area, with the weight version that produced it."""

    item: Any
    weight_version: int


class DataBuffer(Generic[T]):
    """Seeded, epoch-aware cursor over a fixed list of records plus a holding area."""

    def __init__(self, records: Sequence[T], *, seed: int = 0, shuffle: bool = True):
        if len(records) == 0:
            raise ValueError("DataBuffer needs at least one record")
        self._records = records
        self._seed = seed
        self._shuffle = shuffle
        self.epoch_id = 0
        self.sample_offset = 0
        self._held: list[HeldItem] = []
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self._records)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        if self._shuffle:
            random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
        return order

    def get_prompts(self, n: int) -> list[T]:
        """The next `n` records in epoch order, rolling over epochs as needed."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[T] = []
        while len(out) < n:
            if self.sample_offset >= len(self._order):
                self.epoch_id += 1
                self.sample_offset = 0
                self._order = self._epoch_order(self.epoch_id)
            take = min(n - len(out), len(self._order) - self.sample_offset)
            idx = self._order[self.sample_offset : self.sample_offset + take]
            out.extend(self._records[i] for i in idx)
            self.sample_offset += take
        return out

    # -- holding area -------------------------------------------------------------------------

    def hold(self, items: Sequence[Any], weight_version: int) -> None:
        """Put items in the holding area; they are served (FIFO) before fresh prompts."""
        self._held.extend(HeldItem(item, weight_version) for item in items)

    def take_held(self, max_n: int | None = None) -> list[HeldItem]:
        """Remove and return up to `max_n` held items (all when None), oldest first."""
        n = len(self._held) if max_n is None else min(max_n, len(self._held))
        taken, self._held = self._held[:n], self._held[n:]
        return taken

    @property
    def n_held(self) -> int:
        return len(self._held)

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self._seed,
            "shuffle": self._shuffle,
            "n_records": len(self._records),
            "epoch_id": self.epoch_id,
            "sample_offset": self.sample_offset,
            "held": [{"item": h.item, "weight_version": h.weight_version} for h in self._held],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor and holding area.

        Raises:
            ValueError: the state was saved for a different dataset size or seed.
        """
        if state["n_records"] != len(self._records) or state["seed"] != self._seed:
            raise ValueError(
                f"DataBuffer state is for {state['n_records']} records with seed "
                f"{state['seed']}, this buffer has {len(self._records)} records with seed "
                f"{self._seed}: resume with the same data and data.shuffle_seed"
            )
        self._shuffle = state["shuffle"]
        self.epoch_id = state["epoch_id"]
        self.sample_offset = state["sample_offset"]
        self._order = self._epoch_order(self.epoch_id)
        self._held = [HeldItem(h["item"], h["weight_version"]) for h in state["held"]]
