"""The viewer's test kit: a synthetic run directory in the real format, and headless chromium.

`write_synthetic_run` writes what an RL run with `train.dump_rollouts: true` writes
(`rollouts.jsonl` by the real `RolloutDumpWriter`, `metrics.jsonl` by the real `JsonlLogger`),
with every shape the page must show: failed and truncated samples, multi-turn samples with tool
calls and environment tokens (loss mask 0), agent branches (`sub_index` 1), reward components.
It has no tokenizer (tokens show as ids), so it is cheap at any length: benchmarks/viewer_load.py
writes a 300-step one.

`chromium_dom(url)` runs Debian's chromium headless and returns the DOM after the page's
scripts ran, and the console lines it printed (an uncaught error or a console message).
`DevToolsPage(url, tmp)` keeps a page open and drives it over the DevTools protocol (the
`websockets` package of the dev extra), for a page that changes while it is open.
"""

from __future__ import annotations

import contextlib
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


class DevToolsPage:
    """A page in headless chromium driven over the DevTools protocol (for what --dump-dom cannot
    show: a page that changes while it is open). `evaluate(js)` returns the value; `wait_for(js)`
    polls until it is truthy; `problems` collects uncaught exceptions and console messages."""

    def __init__(self, url: str, tmp: Path, *, start_timeout_s: float = 60):
        import json
        import time
        import urllib.request

        from websockets.sync.client import connect

        self._proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--disable-gpu", "--no-sandbox",
             "--remote-debugging-port=0", f"--user-data-dir={tmp}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        port_file = tmp / "DevToolsActivePort"
        deadline = time.monotonic() + start_timeout_s
        while not port_file.is_file() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self._proc.poll() is not None:
                self.close()
                raise TimeoutError(
                    f"chromium did not open its DevTools port in {start_timeout_s} s"
                )
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:
            target = next(t for t in json.load(answer) if t["type"] == "page")
        self._stack = contextlib.ExitStack()
        self._ws = self._stack.enter_context(
            connect(target["webSocketDebuggerUrl"], max_size=2**26)
        )
        self._id = 0
        self.problems: list[str] = []
        self._call("Runtime.enable")
        self._call("Page.enable")
        self._call("Page.navigate", url=url)

    def _call(self, method: str, **params):
        import json

        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=30))
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            if message.get("method") == "Runtime.exceptionThrown":
                self.problems.append(str(message["params"]["exceptionDetails"]))
            elif message.get("method") == "Runtime.consoleAPICalled":
                self.problems.append(str(message["params"]["args"]))

    def evaluate(self, expression: str):
        result = self._call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, *, timeout_s: float, what: str):
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s} s for {what} ({expression})")
            time.sleep(0.1)

    def close(self) -> None:
        if getattr(self, "_stack", None) is not None:
            self._stack.close()
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
