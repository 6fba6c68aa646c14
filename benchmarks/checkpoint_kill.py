"""SIGKILL the SFT trainer mid-checkpoint, again and again; then resume and compare (issue 15).

1. Reference: `examples/run_sft.py --config configs/sft_tiny.yaml` for `--max-steps` steps,
   a checkpoint every `--checkpoint-every` steps, uninterrupted.
2. Kill loop, `--kills` times: start the same run with `--resume` in another output dir, watch
   its checkpoint dir every millisecond, and SIGKILL it while its second checkpoint is being
   written (so every start makes progress: its first write completes); a kill that lands
   after the rename is not counted.
   Each time it records: the temp dir the kill left, whether any temp dir of an earlier
   (dead) writer was still there when the next start wrote its first checkpoint (it must have
   been reclaimed), and whether a child process of the trainer outlived it.
3. Resume to the end; compare with the reference: no temp dir left, every step's loss in
   metrics.jsonl, and the final weights.

    .venv/bin/python benchmarks/checkpoint_kill.py [--kills 10] [--max-steps 30] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path

TMP_MARK = ".tmp-"  # training/backend/checkpoint.py's marker: `.<name>.tmp-<pid>`


def sft_command(out: Path, args: argparse.Namespace, resume: bool) -> list[str]:
    cmd = [sys.executable, "examples/run_sft.py", "--config", "configs/sft_tiny.yaml",
           "--output-dir", str(out), "--max-steps", str(args.max_steps),
           f"train.checkpoint_every={args.checkpoint_every}", "train.eval_every=100000",
           "train.log_every=1", "train.greedy_eval_samples=0"]  # fmt: skip
    return cmd + (["--resume"] if resume else [])


def temp_dirs(checkpoints: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(checkpoints) if TMP_MARK in n)
    except FileNotFoundError:
        return []


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def kill_once(out: Path, args: argparse.Namespace, log) -> dict:
    """Start a resuming run, SIGKILL it mid-checkpoint; what was seen."""
    checkpoints = out / "checkpoints"
    proc = subprocess.Popen(sft_command(out, args, resume=True), cwd=harness.REPO,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    mine = f"{TMP_MARK}{proc.pid}"
    deadline = time.monotonic() + 600
    seen: list[str] = []
    writes: set[str] = set()  # checkpoints this process started writing
    while time.monotonic() < deadline and proc.poll() is None:
        seen = temp_dirs(checkpoints)
        writes |= {n for n in seen if n.endswith(mine) and n.startswith(".step_")}
        if len(writes) == 2:  # the first write completed (progress), the second is cut
            break
        time.sleep(0.001)
    else:
        proc.kill()
        proc.wait(10)
        return {"killed": False, "finished": proc.returncode == 0}
    time.sleep(random.uniform(0, 0.03))  # somewhere inside the write, not always its start
    kids = children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    left = temp_dirs(checkpoints)
    time.sleep(1.0)
    return {
        "killed": any(n.endswith(mine) for n in left),  # the write was cut
        "cut": sorted(n.split(TMP_MARK)[0][1:] for n in left if n.endswith(mine)),
        "stale_at_next_write": [n for n in seen if not n.endswith(mine)],
        "children_alive": [k for k in kids if alive(k)],
        "left": left,
    }


def metrics(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), f"metrics.jsonl repeats steps: {steps}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def weights_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert left.keys() == right.keys()
    return max(float((left[k] - right[k]).abs().max()) for k in left)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 kills, 12 steps")
    args = parser.parse_args()
    if args.quick:
        harness.apply_quick(args, parser, kills=3, max_steps=12)
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="checkpoint-kill-"))
    ref, run = work / "reference", work / "killed"
    with open(work / "runs.log", "w") as log:
        subprocess.run(sft_command(ref, args, resume=False), cwd=harness.REPO, stdout=log,
                       stderr=subprocess.STDOUT, check=True, timeout=1800)  # fmt: skip
        kills, attempts = [], 0
        while len(kills) < args.kills and attempts < 3 * args.kills:
            attempts += 1
            outcome = kill_once(run, args, log)
            if outcome.get("finished"):
                raise SystemExit("the run finished before every kill: raise --max-steps")
            if outcome["killed"]:
                kills.append(outcome)
                print(f"kill {len(kills)}: left {outcome['left']}", flush=True)
        final = subprocess.run(sft_command(run, args, resume=True), cwd=harness.REPO,
                               stdout=log, stderr=subprocess.STDOUT, timeout=1800)  # fmt: skip
    left_after = temp_dirs(run / "checkpoints")
    ref_loss, run_loss = metrics(ref), metrics(run)
    loss_diff = (
        max(abs(ref_loss[s] - run_loss[s]) for s in ref_loss)
        if ref_loss.keys() == run_loss.keys()
        else float("nan")
    )
    last = f"step_{args.max_steps:06d}"
    w_diff = weights_diff(ref / "checkpoints" / last, run / "checkpoints" / last)
    stale = sum(len(k["stale_at_next_write"]) for k in kills[1:])
    orphans = sum(len(k["children_alive"]) for k in kills)
    rows = [
        ["SIGKILLs mid-checkpoint (temp dir left by the kill)", f"{len(kills)} of {attempts} attempts"],
        ["checkpoints the kills cut", " ".join(",".join(k["cut"]) for k in kills)],
        ["earlier temp dirs still there at the next start's first write", stale],
        ["temp dirs after the final resumed run", len(left_after)],
        ["trainer child processes alive after a kill", orphans],
        ["final resumed run exit code", final.returncode],
        ["steps in metrics.jsonl (reference / killed+resumed)", f"{len(ref_loss)} / {len(run_loss)}"],
        ["max |loss difference| per step vs uninterrupted", loss_diff],
        ["max |weight difference| at the last step", w_diff],
    ]  # fmt: skip
    table = harness.md_table(["check", "value"], rows)
    notes = [
        f"- {args.max_steps} steps, a checkpoint every {args.checkpoint_every} steps; kill "
        "0-30 ms after the temp dir of each start's second checkpoint appears. Runs log: "
        + str(work / "runs.log"),
        "- Reclaiming stale temp dirs on start is `training/backend/checkpoint.py: reclaim_temp_dirs`.",
    ]
    harness.publish("checkpoint_kill", "SFT trainer SIGKILLed mid-checkpoint (issue 15)",
                    "kill loop", [table], notes, quick=args.quick, started=started)  # fmt: skip
    ok = len(kills) == args.kills and not stale and not left_after and not orphans
    ok = ok and final.returncode == 0 and loss_diff == 0.0 and w_diff == 0.0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
