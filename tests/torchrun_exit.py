"""One finished 2-rank RL job, judged at its exit: the shape of the flake of issue 33.

`run_once` launches `examples/run_rl.py` under torchrun (2 ranks, a reference model, a local
engine, a checkpoint at the last of 3 steps) through `tests/exit_probe.py` and says what went
wrong, if anything: a non-zero exit, a rank that aborted, a rank with gloo threads alive at
finalization, or a last checkpoint that is not complete.

    python tests/torchrun_exit.py --runs 30 [--root CHECKOUT ...]   # failures per checkout

With several `--root`s the runs alternate between them, so that each sees the same load: that
is how the rate before a fix is measured beside the rate after it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
# The recipe writes and tokenizes 4,000 RL prompts by default (~0.9 CPU s a run); a few steps
# at batch 4 read 20 at most.
SMALL_RL_DATA, SMALL_EVAL_DATA = "data.arithmetic.n_rl=64", "data.arithmetic.n_eval=16"


def rl_args(model_dir: Path, out: Path, steps: int = STEPS) -> list[str]:
    return ["--config", str(ROOT / "configs" / "rl_tiny.yaml"), "--model", str(model_dir),
            "--output-dir", str(out / "rl"), "rollout.batch_size=4",
            "rollout.n_samples_per_prompt=4", "rollout.filter_groups=none",
            "train.eval_samples=8", "train.eval_every=1000", f"train.checkpoint_every={STEPS}",
            "optim.lr=1e-3", "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
            "algorithm.overrides.kl_coef=0.05",  # a reference model, sharded like the policy
            f"data.task_dir={out / 'data'}", SMALL_RL_DATA, SMALL_EVAL_DATA,
            "--max-steps", str(steps)]  # fmt: skip


def launch_probed(root: Path, args: list[str], cwd: Path, timeout: float = 300):
    """torchrun, 2 ranks: `root`'s examples/run_rl.py through this checkout's exit probe."""
    probe = ROOT / "tests" / "exit_probe.py"
    # another checkout runs in its own venv (`make setup` there): its packages are installed
    # in editable mode, which no PYTHONPATH overrides
    python = root / ".venv" / "bin" / "python" if root != ROOT else Path(sys.executable)
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(probe), str(root / "examples" / "run_rl.py"), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def judge(proc: subprocess.CompletedProcess, out: Path) -> list[str]:
    """What went wrong with a finished launch (empty: nothing)."""
    problems = []
    if proc.returncode != 0:
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
        problems.append(f"exit {proc.returncode} (rank exit codes {codes})")
    if "terminate called" in proc.stderr:
        problems.append("a rank called std::terminate")
    for rank in (0, 1):
        m = re.search(rf"exit probe: rank {rank} gloo threads (\[[^\]]*\])", proc.stderr)
        if m is None:
            problems.append(f"rank {rank} did not reach interpreter finalization normally")
        elif m.group(1) != "[]":
            problems.append(f"rank {rank} had gloo threads at finalization: {m.group(1)}")
    ckpt = out / "rl" / "checkpoints"
    latest = ckpt / "latest"
    name = latest.read_text().strip() if latest.exists() else None
    if name != f"step_{STEPS:06d}":
        problems.append(f"latest checkpoint is {name!r}, not step {STEPS}")
    else:
        missing = [f for f in ("config.json", "model.safetensors", "trainer_state.json")
                   if not (ckpt / name / f).is_file()]  # fmt: skip
        if missing:
            problems.append(f"the last checkpoint lacks {missing}")
        else:
            state = json.loads((ckpt / name / "trainer_state.json").read_text())
            if state.get("step") != STEPS:
                problems.append(f"the last checkpoint's step is {state.get('step')}")
    leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith(".")] if ckpt.is_dir() else []
    if leftovers:
        problems.append(f"temporary checkpoint directories left: {leftovers}")
    return problems


def run_once(root: Path, model_dir: Path, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    try:
        proc = launch_probed(root, rl_args(model_dir, out), cwd=out)
    except subprocess.TimeoutExpired:
        return ["the job did not end within 300 s"]
    problems = judge(proc, out)
    if problems:
        (out / "stderr.txt").write_text(proc.stderr)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per checkout")
    parser.add_argument("--root", type=Path, action="append", help="checkouts (default: this)")
    parser.add_argument("--out", type=Path, default=None, help="keep run dirs here")
    args = parser.parse_args()
    roots = args.root or [ROOT]
    from training.backend.tiny_model import build_tiny_model

    base = args.out or Path(tempfile.mkdtemp(prefix="torchrun_exit_"))
    model_dir = build_tiny_model(base / "tiny_model", seed=0)
    # failed: any problem; exit: the job itself failed (what a user or a scheduler sees)
    tally = {r: {"failed": 0, "exit": 0} for r in roots}
    t0 = time.monotonic()
    for i in range(args.runs):
        for k, root in enumerate(roots):
            problems = run_once(root, model_dir, base / f"run{i:03d}_{k}")
            tally[root]["failed"] += bool(problems)
            tally[root]["exit"] += any(
                p.startswith(("exit", "a rank", "the job")) for p in problems
            )
            status = "ok" if not problems else "FAILED: " + "; ".join(problems)
            print(f"[{time.monotonic() - t0:6.0f} s] run {i + 1} {root}: {status}", flush=True)
    for root in roots:
        t = tally[root]
        print(f"{root}: {t['failed']} of {args.runs} runs failed a check; "
              f"{t['exit']} of {args.runs} jobs exited non-zero")  # fmt: skip
    return 0 if not any(t["failed"] for t in tally.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
