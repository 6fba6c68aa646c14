"""Fault matrix (issue 49): RL runs of the real CLI under engine and trainer faults, measured.

    python benchmarks/fault_matrix.py [--paths async-disk,sync-distributed,...] [--engines 1,2]
        [--faults a,b,c,d,e] [--steps 6] [--jobs 1] [--timeout-s 300] [--json PATH]
        [--write-results [--results benchmarks/RESULTS.md]] [--out runs/fault_matrix]

Paths: `{sync,overlap,async}-{disk,distributed}` (rollout.mode, engines.weight_transport) on
configs/rl_tiny.yaml, and `agent` (configs/agent_tiny.yaml: env.kind=agent, the calculator agent
of examples/agent_rl.py speaking the OpenAI API through the proxy; sync, disk), and
`{sync,overlap,async}-workers`: generation in `rollout.workers` = engines processes (one
engine each; docs/scale.md), disk weights. Engines: 1 or 2
supervised local engines (relaunched on their port when they die), each behind an
`engines.testing.fault_proxy` (engines/testing/fault_fleet.py). Faults:

- 0: none, the baseline (not in the default set).
- a: one reset: the 5th /generate through engine 0's proxy is closed without an answer.
- b: a 10 % fault mix on every /generate: 2 % each of reset, 500, truncated, non-JSON, hang (8 s).
- c: an engine kill: SIGKILL to the last engine's process once step 2 is dumped.
- d: a hung weight update: engine 0's proxy holds the third /update_weights_from_disk
  (/update_weights_from_distributed with distributed transport; the first is the push at start)
  for HANG_S (150 s) or until the trainer closes it, then closes it.
- e: a trainer SIGKILL mid-push: when a weight-push request (/update_weights_from_disk,
  /init_weights_update_group, /update_weights_from_distributed) reaches a proxy after step 2 is
  dumped, the trainer gets SIGKILL; the same command with --resume then finishes the run
  (train.checkpoint_every=1).
- w: a rollout worker SIGKILL (`-workers` paths only): when a /generate reaches a proxy after
  step 2 is dumped (mid-batch), the newest of the trainer's rollout worker processes gets
  SIGKILL; the trainer restarts it and sends its prompts again (rollouts/workers/manager.py).

Each run is a subprocess of examples/run_rl.py (examples/agent_rl.py for `agent`), on a fresh
tiny model (seed 0, shared by all runs), 4 prompts x 4 samples per step, `--steps` steps, with a
per-attempt deadline (`--timeout-s`; past it the trainer gets SIGKILL and its exit reads
"timeout"). Per run it records:

- exit: the trainer's exit status(es), in order ("-9" is the harness's own SIGKILL in e).
- steps: the last step of the rollout dump's lineage (training/rl/dump_audit.py).
- lost / twice / stale: from the rollout dump, as defined in training/rl/dump_audit.py: lost =
  samples of prompts the run had taken from its data by its checkpoint SETTLE_STEPS (2) steps
  before its last step (every checkpoint is kept), neither trained, nor held at the end, nor
  accounted as failed or filtered: what a resume from the final checkpoint would never train
  (so a prompt skipped by a resume is lost, and so is one the final checkpoint dropped from its
  held groups while it was in flight); twice = extra trainings of one generation (same prompt, index, response tokens and
  engine logprobs); stale = trained with a weight version older than step - 1 - max lag (0 sync,
  1 overlap, rollout.max_staleness=1 async).
- wait: the longest time any single request (generate or weight push) was outstanding at a
  proxy, and gap: the longest time between consecutive dumped steps (from the trainer's start),
  both in seconds (the gap runs from each trainer start to its exit, so a start-up, a resume
  and a stall before a crash or the deadline are in it); the goal for both is under a minute.
- versions: each engine's weight_version from GET /model_info (directly, after the trainer
  exited) and whether they are one value equal to the trainer's (its last step: the loop pushes
  version N after step N).

The stress tests (tests/test_fault_matrix.py, `make stress`) run cells of this matrix and assert
0 lost, 0 twice, 0 stale, exit 0 and one true version; `--write-results` replaces the
`fault_matrix` section of benchmarks/RESULTS.md (`fault_matrix_workers` when only `-workers`
paths ran).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import trio

from engines.testing.fault_fleet import engine_weight_versions, open_faulty_fleet
from engines.testing.fault_proxy import FaultPlan
from training.rl.dump_audit import ROLLOUT_MODE_LAG, audit_rollout_dump

PATHS = tuple(f"{m}-{t}" for m in ("sync", "overlap", "async") for t in ("disk", "distributed"))
WORKER_PATHS = tuple(f"{m}-workers" for m in ("sync", "overlap", "async"))  # rollout.workers
ALL_PATHS = (*PATHS, "agent", *WORKER_PATHS)
FAULTS = {"0": "none (the baseline)", "a": "one reset", "b": "10 % fault mix", "c": "engine kill", "d": "hung weight update",
          "e": "trainer SIGKILL mid-push", "w": "rollout worker SIGKILL"}  # fmt: skip
MIX = {"reset": 0.02, "500": 0.02, "truncate": 0.02, "nonjson": 0.02, "hang": 0.02}
PUSHES = ("/update_weights_from_disk", "/init_weights_update_group",
          "/update_weights_from_distributed")  # fmt: skip
HANG_S = 150.0  # the hung weight update: longer than any sane push deadline
KILL_AFTER_STEP = 2  # c and e strike once this step is dumped
MAX_STALENESS = 1  # async mode's rollout.max_staleness
SETTLE_STEPS = 2  # lost counts the prompts taken by the checkpoint this many steps before the end


@dataclass(frozen=True)
class Cell:
    path: str
    engines: int
    fault: str

    @property
    def name(self) -> str:
        return f"{self.path}-e{self.engines}-{self.fault}"


def trainer_command(cell: Cell, urls: list[str], model: Path, out: Path, args, resume: bool
                    ) -> list[str]:  # fmt: skip
    common = ["--model", str(model), "--output-dir", str(out), "--max-steps", str(args.steps),
              *[a for u in urls for a in ("--engine-url", u)],
              "--resume" if resume else "--overwrite",
              "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "train.eval_samples=0",
              "train.eval_every=100000", "train.dump_rollouts=true", "rollout.filter_groups=none",
              "train.checkpoint_every=1", "train.keep_last=1000", "engines.generate_timeout_s=10",
              f"data.task_dir={args.out / 'data' / ('multiply' if cell.path == 'agent' else 'arithmetic')}"]  # fmt: skip
    if cell.path == "agent":
        return [sys.executable, "examples/agent_rl.py", "--config", "configs/agent_tiny.yaml",
                *common, "rollout.sampling.max_new_tokens=16", "env.max_response_tokens=48",
                "agent.timeout_s=30"]  # fmt: skip
    mode, transport = cell.path.split("-")
    if transport == "workers":  # K = the engines (one each), disk weights
        common.append(f"rollout.workers={cell.engines}")
        transport = "disk"
    return [sys.executable, "examples/run_rl.py", "--config", "configs/rl_tiny.yaml", *common,
            f"rollout.mode={mode}", f"engines.weight_transport={transport}",
            f"rollout.max_staleness={MAX_STALENESS}",
            "reward.fn=rollouts.tasks.arithmetic:digit_share_reward"]  # fmt: skip


def plans(cell: Cell) -> list[FaultPlan]:
    plain = [FaultPlan() for _ in range(cell.engines)]
    if cell.fault == "a":
        plain[0] = FaultPlan(script=("pass",) * 4 + ("reset",))
    elif cell.fault == "b":
        plain = [FaultPlan(rates=MIX, hang_s=8.0, seed=i) for i in range(cell.engines)]
    elif cell.fault == "d":
        route = PUSHES[2] if cell.path.endswith("distributed") else PUSHES[0]
        plain[0] = FaultPlan(script=("pass", "pass", "hang"), paths=(route,), hang_s=HANG_S)
    return plain


async def run_cell(cell: Cell, model: Path, args) -> dict:
    """One run of the matrix (see the module docstring); never raises for a failed run."""
    out = args.out / cell.name
    out.mkdir(parents=True, exist_ok=True)
    dump = out / "rollouts.jsonl"
    dump.unlink(missing_ok=True)
    started = time.perf_counter()
    exits: list[str] = []
    killed_workers: list[int] = []  # w: the worker pids the harness SIGKILLed
    ticks: list[float] = []  # each trainer start, each dumped step, each trainer exit
    seen = 0
    async with open_faulty_fleet(model, plans(cell), out) as fleet:
        urls = [m.proxy_url for m in fleet]
        env = {**os.environ, "PYTHONPATH": str(harness.REPO), "OMP_NUM_THREADS": "1"}
        for attempt in range(2):
            log_file = (out / f"trainer_{attempt}.log").open("wb")
            trainer = await trio.lowlevel.open_process(
                trainer_command(cell, urls, model, out, args, resume=attempt > 0),
                cwd=harness.REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)  # fmt: skip
            ticks.append(time.perf_counter())
            killed = {"done": False}

            def kill_trainer(path: str, trainer=trainer, killed=killed) -> None:
                if path in PUSHES and not killed["done"] and _count_lines(dump) >= KILL_AFTER_STEP:
                    killed["done"] = True
                    trainer.send_signal(signal.SIGKILL)

            def kill_worker(path: str, trainer=trainer, killed=killed) -> None:
                due = path == "/generate" and _count_lines(dump) >= KILL_AFTER_STEP
                if due and not killed["done"]:
                    pids = worker_pids(trainer.pid)
                    if pids:  # mid-batch: the workers generate; the newest one gets it
                        killed["done"] = True
                        killed_workers.append(pids[-1])
                        os.kill(pids[-1], signal.SIGKILL)

            hooks = {"e": kill_trainer, "w": kill_worker} if not attempt else {}
            for member in fleet:
                member.proxy.on_request = hooks.get(cell.fault)
            engine_killed = False
            with trio.move_on_after(args.timeout_s) as deadline:
                while trainer.returncode is None:
                    await trio.sleep(0.2)
                    trainer.poll()
                    n = _count_lines(dump)
                    ticks.extend([time.perf_counter()] * (n - seen))
                    seen = max(seen, n)
                    if cell.fault == "c" and not engine_killed and n >= KILL_AFTER_STEP:
                        os.kill(fleet[-1].engine.current.pid, signal.SIGKILL)
                        engine_killed = True
            if deadline.cancelled_caught:
                trainer.kill()
            code = await trainer.wait()
            log_file.close()
            n = _count_lines(dump)
            ticks.extend([time.perf_counter()] * (n - seen + 1))  # its last steps, its exit
            seen = max(seen, n)
            exits.append("timeout" if deadline.cancelled_caught else str(code))
            if not (cell.fault == "e" and killed["done"] and attempt == 0):
                break
        versions = await engine_weight_versions(fleet)
        wait = max((v for m in fleet for v in m.proxy.longest_s.values()), default=0.0)
        counts = [dict(m.proxy.counts) for m in fleet]
    row = {"run": cell.name, "path": cell.path, "engines": cell.engines, "fault": cell.fault,
           "exit": exits, "wait_s": round(wait, 1),
           "gap_s": round(max((b - a for a, b in itertools.pairwise(ticks)), default=0.0), 1),
           "versions": versions, "proxy": counts, "killed_workers": killed_workers,
           "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    try:
        lag = MAX_STALENESS if cell.path.startswith("async") else ROLLOUT_MODE_LAG.get(
            cell.path.split("-")[0], 0)  # fmt: skip
        drawn, held = prompts_drawn(out)
        audit = (
            audit_rollout_dump(dump, max_lag=lag, drawn=drawn, held=held) if dump.exists() else None
        )
    except Exception as err:  # a malformed dump is a finding of this run, not the harness's end
        row["error"] = str(err)
        audit = None
    row.update(steps=audit.steps if audit else 0, lost=audit.lost if audit else None,
               twice=audit.twice if audit else None, stale=audit.stale if audit else None,
               rerun_steps=audit.rerun_steps if audit else 0,
               dropped=audit.dropped if audit else None)  # fmt: skip
    row["versions_ok"] = len(set(versions)) == 1 and versions[0] == str(row["steps"])
    row["ok"] = (exits[-1] == "0" and row["steps"] == args.steps and row["lost"] == 0
                 and row["twice"] == 0 and row["stale"] == 0 and row["versions_ok"]
                 and (cell.fault != "w" or bool(killed_workers)))  # w: it struck  # fmt: skip
    return row


_STREAMS: dict[str, list] = {}


def prompts_drawn(out: Path, settle_steps: int = SETTLE_STEPS) -> tuple[list, list]:
    """The prompts the run had taken from its data (token ids, in order) by its checkpoint
    `settle_steps` steps before its last one (in async mode the prompts taken since may still be
    legitimately in flight when the run ends), and those held at its end (its last checkpoint);
    ([], []) without such a checkpoint."""
    from training.backend.model_io import load_tokenizer
    from training.config import load_config
    from training.data.buffer import DataBuffer
    from training.recipes.rl import load_prompts
    from training.rl_config import RLRunConfig

    states = sorted((out / "checkpoints").glob("step_*/trainer_state.json"))
    if len(states) <= settle_steps:
        return [], []
    state = json.loads(states[-1 - settle_steps].read_text(encoding="utf-8"))
    state = state["extra"]["data_buffer"]
    held = json.loads(states[-1].read_text(encoding="utf-8"))["extra"]["data_buffer"]["held"]
    config = load_config(RLRunConfig, out / "config.yaml")
    key = str(config.data.task_dir)
    if key not in _STREAMS:
        prompts, _ = load_prompts(config, load_tokenizer(config.model.path))
        _STREAMS[key] = [p.prompt_ids for p in prompts]
    buffer = DataBuffer(_STREAMS[key], seed=state["seed"], shuffle=state["shuffle"])
    drawn = buffer.get_prompts(state["epoch_id"] * state["n_records"] + state["sample_offset"])
    return drawn, [h["item"]["prompt"]["prompt_ids"] for h in held]


def worker_pids(trainer_pid: int) -> list[int]:
    """The trainer's rollout worker processes (`python -m rollouts.workers.worker`, its
    children), oldest first, from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue  # it ended meanwhile
        if int(fields[1]) == trainer_pid and b"rollouts.workers.worker" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


HEADERS = ("run", "exit", "steps", "lost", "twice", "stale", "wait s", "gap s", "versions",
           "one true", "wall s", "ok")  # fmt: skip


def table_row(r: dict) -> list:
    return [r["run"], "/".join(r["exit"]), r["steps"], r["lost"], r["twice"], r["stale"],
            r["wait_s"], r["gap_s"], ",".join(str(v) for v in r["versions"]),
            "yes" if r["versions_ok"] else "NO", r["wall_s"], "yes" if r["ok"] else "NO"]  # fmt: skip


def cells(args) -> list[Cell]:
    return [Cell(p, n, f) for p in args.paths for n in args.engines for f in args.faults]


async def run_matrix(args) -> list[dict]:
    from training.backend.tiny_model import ensure_tiny_model
    from training.config import load_config
    from training.rl_config import RLRunConfig

    model = ensure_tiny_model(args.out / "model", seed=0)
    for config, task in (
        ("configs/rl_tiny.yaml", "arithmetic"),
        ("configs/agent_tiny.yaml", "multiply"),
    ):
        # the task files once, before runs that share them start (with --jobs > 1)
        load_config(RLRunConfig, config, [f"data.task_dir={args.out / 'data' / task}",
                                          f"model.path={model}"]).data.write_task_files()  # fmt: skip
    todo, rows = cells(args), {}
    limiter = trio.CapacityLimiter(args.jobs)

    async def one(cell: Cell) -> None:
        async with limiter:
            rows[cell] = await run_cell(cell, model, args)
            print(f"{cell.name}: {json.dumps(rows[cell])}", flush=True)

    async with trio.open_nursery() as nursery:
        for cell in todo:
            nursery.start_soon(one, cell)
    return [rows[c] for c in todo]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    split = partial(str.split, sep=",")
    p.add_argument("--paths", type=split, default=list(ALL_PATHS), help=",".join(ALL_PATHS))
    p.add_argument("--engines", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--faults", type=split, default=list("abcde"),
                   help="0,a,b,c,d,e,w (0: none; w: -workers paths only)")  # fmt: skip
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per trainer attempt")
    p.add_argument("--out", type=Path, default=Path("runs/fault_matrix"))
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--write-results", action="store_true",
                   help="replace the fault_matrix section of RESULTS.md (--results); "
                        "fault_matrix_workers when every path is a -workers one")  # fmt: skip
    p.add_argument("--results", type=Path, default=harness.BENCH_DIR / "RESULTS.md",
                   help="the RESULTS.md --write-results writes")  # fmt: skip
    args = p.parse_args(argv)
    bad = [x for x in args.paths if x not in ALL_PATHS] + [
        x for x in args.faults if x not in FAULTS
    ]
    if bad or not set(args.engines) <= {1, 2}:
        p.error(f"unknown {bad or args.engines}: --paths from {','.join(ALL_PATHS)}, --faults "
                f"from {','.join(FAULTS)}, --engines from 1,2")  # fmt: skip
    args.out = args.out.resolve()
    return args


def main() -> int:
    args = parse_args()
    started = time.time()
    rows = trio.run(run_matrix, args)
    table = harness.md_table(HEADERS, [table_row(r) for r in rows])
    notes = ["- Faults: " + "; ".join(f"{k} = {v}" for k, v in FAULTS.items()) + ".",
             "- lost / twice / stale: samples, from the rollout dump (training/rl/dump_audit.py); "
             "wait: the longest single request at a proxy; gap: the longest time between "
             "dumped steps, trainer starts and exits; versions: each engine's GET /model_info after the run, `one true` "
             f"when all equal the trainer's last step. {args.steps} steps, 4 prompts x 4 "
             "samples per step; definitions in benchmarks/fault_matrix.py's docstring.",
             f"- {sum(r['ok'] for r in rows)} of {len(rows)} runs ok; runs took "
             f"{sum(r['wall_s'] for r in rows) / 60:.1f} min in all ({args.jobs} at once)."]  # fmt: skip
    title = "Fault matrix: RL runs under engine and trainer faults (issue 49)"
    key = "fault_matrix"
    if all(p in WORKER_PATHS for p in args.paths):  # its own section: the 70 cells stay
        key, title = "fault_matrix_workers", "Fault matrix with rollout workers (issue 47)"
    print(f"\n{title}\n{table}\n" + "\n".join(notes))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    if args.write_results:
        harness.write_section(key, title, table + "\n\n" + "\n".join(notes),
                              quick=False, started=started, path=args.results)  # fmt: skip
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
