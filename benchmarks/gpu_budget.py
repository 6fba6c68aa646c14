"""The GPU check's time budget (benchmarks/gpu_check.py, `--budget-s`): a device call has at
most 10 minutes, so the check runs its rows most valuable first and, before each optional row
(fused AdamW, a change of issue 43, the peer), estimates the row's cost from the rows measured
so far; a row that would not fit is skipped and its cell says so (the check still exits 0).
One line per finished row is printed and flushed at once, so a run cut off later still shows
what it measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SKIPPED = "skipped: time budget"


@dataclass
class Budget:
    """The time the optional rows may take (the whole script must end inside one device call,
    even if a compile is slow), and each kind of row's rough cost from the rows measured so far
    (`walls`: the longest wall time seen per kind, s)."""

    deadline: float  # time.monotonic() by which the last row must end
    compile_s: float  # a compile's rough cost (CUDA; 0 on CPU, where nothing is compiled)
    walls: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def estimate(self, kind: str) -> float:
        """Rough seconds for a row of `kind`: "sft_fused" (one SFT phase), "peer" (a model
        load, its compile, the SFT steps), "variant" (an SFT and a GRPO phase) or "compile" (a
        variant, slower, with two compiles)."""
        sft = self.walls.get("sft", 0.0)
        variant = self.walls.get("variant", 1.25 * (sft + self.walls.get("grpo_train", 0.0)))
        return {"sft_fused": sft, "peer": 1.5 * sft + self.compile_s, "variant": variant,
                "compile": 1.5 * variant + 2 * self.compile_s}[kind]  # fmt: skip

    def record(self, kind: str, wall_s: float) -> None:
        self.walls[kind] = max(wall_s, self.walls.get(kind, 0.0))


async def optional_row(budget: Budget, name: str, kind: str, run_row) -> dict:
    """`await run_row()` (a row's figures) if the budget leaves time for a row of `kind`, else
    {"error": SKIPPED}; either way one progress line."""
    estimate = budget.estimate(kind)
    if budget.left() < estimate:
        progress(name, f"{SKIPPED} ({budget.left():.0f} s left, ~{estimate:.0f} s needed)")
        return {"error": SKIPPED}
    t0 = time.monotonic()
    row = await run_row()
    budget.record(kind, time.monotonic() - t0)
    progress(name, row, time.monotonic() - t0, budget)
    return row


def progress(name: str, row, wall_s: float | None = None, budget: Budget | None = None) -> None:
    """One line per finished row, flushed: a run killed later still shows what it measured."""
    if isinstance(row, str):
        text = row
    elif "error" in row:
        text = row["error"][:200]
    else:
        phases = [(f"{ph} ", f) for ph, f in row.items() if ph in ("sft", "grpo")] or [("", row)]
        text = "; ".join(f"{ph}{f['step_s']:.3f} s/step, {f['tokens_per_s']:,.0f} tokens/s, "
                         f"loss {f['loss']:.4g}" for ph, f in phases)  # fmt: skip
    took = f" in {wall_s:.0f} s" if wall_s is not None else ""
    left = f"; {budget.left():.0f} s left" if budget is not None else ""
    print(f"gpu_check: {name}{took}: {text}{left}", flush=True)


def failed(row: dict) -> bool:
    """A row that raised (a skipped row, for time or on CPU, did not fail)."""
    return "error" in row and not row["error"].startswith("skipped")
