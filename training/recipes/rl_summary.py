"""What a person reads of an RL run: each step's console line and the summary at its end.

The summary (`RLSummary.line()`) gives held-out accuracy and mean reward before and after
(exact-match accuracy can stay at 0 while a partial-credit reward moves), and the engines a run
finished without (`EngineWatch`): a run that lost one of two engines says so at its end, not only
in the one WARNING logged when it went down.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def rl_console_keys(ema_metrics: list[str]) -> tuple[str, ...]:
    """What an RL step's console line shows. A GRPO-family loss is ~0 by construction (the
    advantages of a group have mean 0), so the line carries what says the model moves:
    grad_norm, the clipped share of tokens and how far the update went (kl_to_old)."""
    return ("reward_mean", *(f"{k}_ema" for k in ema_metrics), "accuracy", "eval_accuracy",
            "eval_reward_mean", "loss", "grad_norm", "clip_fraction", "kl_to_old",
            "teacher_kl", "time_step_s", "weight_version")  # fmt: skip


@dataclass(frozen=True)
class RLSummary:
    accuracy_before: float | None
    accuracy_after: float | None
    steps: int
    wall_time_s: float
    checkpoint: Path | None
    reward_curve: tuple[float, ...]
    tool_use_before: float | None = None  # share of episodes that called a tool (tool envs)
    tool_use_after: float | None = None
    tool_success_before: float | None = None  # share of tool calls that succeeded
    tool_success_after: float | None = None
    # held-out mean reward (partial credit moves when exact-match accuracy does not)
    reward_before: float | None = None
    reward_after: float | None = None
    engines_total: int | None = None  # engines of the pool (None: not a pool, e.g. a gateway)
    engines_lost: tuple[str, ...] = ()  # "url: why at step K" of each engine down at the end

    def line(self) -> str:
        def pct(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1%}"

        def num(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.4g}"

        gain = ""
        if self.accuracy_before is not None and self.accuracy_after is not None:
            gain = f" ({(self.accuracy_after - self.accuracy_before) * 100:+.1f} points)"
        reward = ""
        if self.reward_before is not None or self.reward_after is not None:
            moved = ""
            if self.reward_before is not None and self.reward_after is not None:
                moved = f" ({self.reward_after - self.reward_before:+.4g})"
            reward = (f" heldout_reward_mean before={num(self.reward_before)} "
                      f"after={num(self.reward_after)}{moved}")  # fmt: skip
        tools = ""
        if self.tool_use_before is not None:
            tools = (f" tool_use before={pct(self.tool_use_before)} "
                     f"after={pct(self.tool_use_after)} tool_success "
                     f"before={pct(self.tool_success_before)} "
                     f"after={pct(self.tool_success_after)}")  # fmt: skip
        lost = ""
        if self.engines_lost and self.engines_total is not None:
            serving = self.engines_total - len(self.engines_lost)
            lost = (f"; finished on {serving} of {self.engines_total} engines; lost "
                    f"{'; '.join(self.engines_lost)}")  # fmt: skip
        heldout = (f"heldout_accuracy before={pct(self.accuracy_before)} "
                   f"after={pct(self.accuracy_after)}{gain}{reward}")  # fmt: skip
        if self.accuracy_before is None and self.accuracy_after is None and not reward:
            heldout = "heldout: not measured (no data.eval_path)"
        return (
            f"RL done: {heldout}{tools} steps={self.steps} "
            f"wall_time={self.wall_time_s:.1f}s checkpoint={self.checkpoint}{lost}"
        )


class EngineWatch:
    """A logger `(step, metrics)` that notes, after each step, which engines of `pool` are
    down and since which step (with the pool's reason); an engine back in service is forgotten.

    `pool`: an `EnginePool` (anything else, e.g. a gateway, has no per-engine health: nothing
    is noted).
    """

    def __init__(self, pool: Any) -> None:
        self._statistics = getattr(pool, "statistics", None)
        self.total: int | None = None
        self._down: dict[str, tuple[int, str]] = {}  # url -> (first step seen down, why)

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._statistics is None:
            return
        engines = self._statistics().engines
        self.total = len(engines)
        for e in engines:
            if e.healthy:
                self._down.pop(e.url, None)
            elif e.url not in self._down:
                self._down[e.url] = (step, e.down_reason or "down")

    def lost(self) -> tuple[str, ...]:
        """`url: why at step K` of each engine down when last looked at."""
        return tuple(f"{url}: {why} at step {step}" for url, (step, why) in self._down.items())
