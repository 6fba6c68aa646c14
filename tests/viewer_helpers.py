"""The viewer's test kit: a synthetic run directory in the real format, and headless chromium.

`write_synthetic_run` writes what an RL run with `train.dump_rollouts: true` writes
(`rollouts.jsonl` by the real `RolloutDumpWriter`, `metrics.jsonl` by the real `JsonlLogger`),
with every shape the page must show: failed and truncated samples, multi-turn samples with tool
calls and environment tokens (loss mask 0), agent branches (`sub_index` 1), reward components.
It has no tokenizer (tokens show as ids), so it is cheap at any length: benchmarks/viewer_load.py
writes a 300-step one.

`chromium_dom(url)` runs Debian's chromium headless and returns the DOM after the page's
scripts ran, and the console lines it printed (an uncaught error or a console message).
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

from rollouts.types import RolloutBatch, Sample, ToolCallRecord
from training.loops.loggers import JsonlLogger
from training.rl.rollout_dump import RolloutDumpWriter

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
MISSING_CHROMIUM = "no chromium (Debian: apt-get install chromium): the browser tests need it"


def have_chromium() -> bool:
    return Path(CHROMIUM).is_file()


def synthetic_sample(rng: random.Random, step: int, g: int, i: int, sub: int, tokens: int
                     ) -> Sample:  # fmt: skip
    """One sample; which kind it is follows from (g, i): see the module docstring."""
    kind = (g + i) % 5
    n = tokens if kind != 4 else tokens // 2
    ids = [rng.randrange(5, 400) for _ in range(n)]
    mask = [1] * n
    tools: tuple[ToolCallRecord, ...] = ()
    if kind == 2:  # a tool turn in the middle: the tool's output tokens are not trained
        for t in range(n // 3, n // 3 + 4):
            mask[t] = 0
        ok = i % 2 == 0
        tools = (ToolCallRecord("calculator", {"expr": f"{g}*{i}"}, str(g * i) if ok else "",
                                success=ok, latency_s=0.01 * (i + 1),
                                error=None if ok else "ZeroDivisionError"),)  # fmt: skip
    lps = [0.0 if not m else -rng.random() * 3 for m in mask]
    status, finish, error = "completed", "stop", None
    if kind == 3:
        status, finish = "truncated", "length"
    if kind == 4 and i == 1:
        status, error = "failed", "reward raised ValueError: could not parse <b>answer</b>"
    correct = float(rng.random() < min(0.9, 0.2 + step / 300))
    return Sample(
        prompt_ids=(1, 2, 3, 10 + g),
        response_ids=ids,
        loss_mask=mask,
        rollout_logprobs=lps,
        response_text="<script>alert(1)</script> " * (kind == 1),
        status=status,
        error=error,
        group_id=g,
        index_in_group=i,
        sub_index=sub,
        weight_version=max(0, step - 1 - (g % 2)),
        metadata={"answer": str(g)},
        tool_calls=tools,
        finish_reason=finish,
    ).with_reward(correct + 0.1 * (n % 3), {"correct": correct, "length": 0.1 * (n % 3)})


def write_synthetic_run(run_dir: Path, *, steps: int, groups: int = 4, n: int = 4,
                        tokens: int = 24, seed: int = 0) -> Path:  # fmt: skip
    """A run directory (rollouts.jsonl, metrics.jsonl) of `steps` steps; returns it."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump, metrics = (
        RolloutDumpWriter(run_dir / "rollouts.jsonl"),
        JsonlLogger(run_dir / "metrics.jsonl"),
    )
    for step in range(1, steps + 1):
        batch_groups = []
        for g in range(groups):
            group = [synthetic_sample(rng, step, g, i, 0, tokens) for i in range(n)]
            if g % 4 == 2:  # an agent session that branched: a second sample of member 0
                group.append(synthetic_sample(rng, step, g, 0, 1, tokens))
            batch_groups.append(tuple(group))
        batch = RolloutBatch(tuple(batch_groups), step_id=step, epoch_id=0)
        samples = batch.samples
        row = {"reward_mean": sum(s.reward for s in samples) / len(samples),
               "samples_failed": float(sum(s.status == "failed" for s in samples)),
               "loss": 1.0 / step, "staleness_max": 1.0}  # fmt: skip
        dump(step, RolloutBatch(batch.groups, step, 0, metrics=row))
        metrics(step, row)
    dump.close()
    metrics.close()
    return run_dir


def chromium_dom(
    url: str, *, budget_ms: int = 5000, timeout_s: float = 60
) -> tuple[str, list[str]]:
    """The DOM of `url` after its scripts ran (virtual time `budget_ms`), and the console lines
    (console messages and uncaught errors) chromium logged."""
    out = subprocess.run(
        [CHROMIUM, "--headless=new", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
         "--v=0", f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
        capture_output=True, text=True, timeout=timeout_s, check=True,
    )  # fmt: skip
    console = [line for line in out.stderr.splitlines()
               if ":CONSOLE" in line or "Uncaught" in line]  # fmt: skip
    return out.stdout, console


def count(dom: str, pattern: str) -> int:
    return len(re.findall(pattern, dom))
