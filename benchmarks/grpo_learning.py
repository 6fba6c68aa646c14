"""GRPO learning speed: run_rl_training + the local engine vs TRL's GRPOTrainer, same budget.

Both arms start from the same SFT'd tiny model and get the same wall-clock training budget
(`--budget-s`); the number that matters is held-out accuracy against training wall-clock.
- rollouts: `run_rl_recipe` on configs/rl_tiny.yaml (what `examples/run_rl.py` runs): a local
  engine process generates, then the trainer trains (sync mode; each with rl_tiny's thread
  count, 1 + 1 on 2 cores), then weights are exported and pushed to the engine, every step.
  `rollouts_2t` is the same with 2 threads for each (they take turns, so each may use every
  core: faster on a machine of its own, much slower when other jobs share it).
  `rollouts_overlap` is the same with `rollout.mode=overlap` (batch
  k+1 generated while training on k, one step off-policy; 1 + 1 threads, since they run at
  the same time).
- trl: TRL `GRPOTrainer` with `use_vllm=False` in one process with 2 torch threads (the whole
  machine): it generates with HF `generate`, then trains.
Matched: the RL prompts and reward of the rl_tiny recipe (`correctness_reward`, exact match
of the last integer), prompts per step and group size (`--prompts` x `--group`), max
completion length, temperature 1 with no top-k/top-p, learning rate (constant, no warmup),
AdamW betas 0.9/0.95, grad clip 1.0, no KL (TRL's default beta=0), GRPO advantages with the
group std (TRL `scale_rewards="group"`), PPO clip 0.2, per-sequence token mean
(TRL `loss_type="grpo"`), one update per batch (TRL `num_iterations=1`).

Accuracy is measured the same way for both, after the runs: each arm saves its weights at
`--points` evenly spaced moments of its training time (saving is excluded from the clock) and
one evaluator greedy-decodes the held-out prompts with every snapshot. Training time runs from
the start of the first step (model loading, engine launch and dataset preparation are not
counted for either arm). Seconds per step is the median step time after the first two steps;
completions/s counts every generated completion. The arms alternate in every repeat.

The starting model comes from the SFT recipe (`examples/run_sft.py --config
configs/sft_tiny.yaml`, written to runs/bench/sft_tiny and reused once finished), or from
`--sft-checkpoint DIR`.

    .venv/bin/python benchmarks/grpo_learning.py [--budget-s 60] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path

import plumbing.threads  # noqa: F401  (before torch: the project's OpenMP settings)

ARMS = {
    "rollouts": "rollouts (sync)",
    "rollouts_2t": "rollouts (sync, 2+2 threads)",
    "rollouts_overlap": "rollouts (overlap)",
    "trl": "TRL GRPOTrainer",
}
RL_CONFIG = harness.REPO / "configs" / "rl_tiny.yaml"
SFT_CONFIG = harness.REPO / "configs" / "sft_tiny.yaml"


class Timeline:
    """Step-end times on the training clock (pauses for snapshots excluded), and snapshots."""

    def __init__(self, budget_s: float, points: int, out: Path) -> None:
        self.budget_s, self.points, self.out = budget_s, points, out
        self.start: float | None = None
        self.excluded = 0.0
        self.steps: list[dict] = []
        self.snapshots: list[dict] = []

    def now(self) -> float:
        assert self.start is not None
        return time.perf_counter() - self.start - self.excluded

    def step_done(self, record: dict, save) -> bool:
        """Record a finished step, snapshot if a point was crossed; True when over budget."""
        t = self.now()
        self.steps.append({"t": t, **record})
        next_point = self.budget_s * (len(self.snapshots) + 1) / self.points
        over = t >= self.budget_s
        if t >= next_point or over:
            t0 = time.perf_counter()
            path = self.out / f"step_{len(self.steps):05d}"
            save(path)
            self.snapshots.append({"t": t, "step": len(self.steps), "path": str(path)})
            self.excluded += time.perf_counter() - t0
        return over

    def result(self) -> dict:
        return {"steps": self.steps, "snapshots": self.snapshots,
                "rss_mb": harness.peak_rss_mb_self()}  # fmt: skip


# ----- arm: rollouts (a child process) -------------------------------------------------------


def run_rollouts(args, mode: str) -> dict:
    import trio

    from training.config import load_config
    from training.recipes.rl import run_rl_recipe
    from training.rl_config import RLRunConfig

    out = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    config = load_config(RLRunConfig, RL_CONFIG, [
        f"output_dir={out / 'run'}", f"model.path={args.sft_checkpoint}",
        "train.max_steps=1000000", "train.eval_samples=0", "train.checkpoint_every=1000000",
        "train.log_every=1000000", f"rollout.mode={mode}", f"rollout.batch_size={args.prompts}",
        f"rollout.n_samples_per_prompt={args.group}",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}", f"optim.lr={args.lr}",
        "optim.schedule=constant", "optim.warmup_steps=0", *args.rollouts_overrides,
    ])  # fmt: skip
    clock = Timeline(args.budget_s, args.points, out / "snapshots")
    n = args.group

    async def main() -> None:
        with trio.CancelScope() as scope:

            def on_step(step: int, m: dict) -> None:
                if clock.start is None:
                    clock.start = time.perf_counter() - m["time_step_s"]
                exported = out / "run" / "weights" / f"v{m['weight_version']:06d}"
                record = {"completions": m["groups_launched"] * n,
                          "generate_s": m["time_generate_s"], "train_s": m["time_train_s"],
                          "sync_s": m["time_sync_s"], "reward": m.get("reward_mean")}  # fmt: skip
                if clock.step_done(record, lambda p: shutil.copytree(exported, p,
                                                                     copy_function=os.link)):  # fmt: skip
                    scope.cancel()

            await run_rl_recipe(config, on_step=on_step)

    trio.run(main)
    return clock.result()


# ----- arm: TRL (a child process) ------------------------------------------------------------


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollouts.tasks.arithmetic import is_correct
    from training.backend.pytorch import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in Path(args.train_file).read_text().splitlines()]
    data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in records])

    def correctness(completions, answer, **kwargs) -> list[float]:
        return [float(is_correct(c[0]["content"], a)) for c, a in zip(completions, answer, strict=True)]  # fmt: skip

    out = Path(tempfile.mkdtemp(prefix="bench_trl_"))
    clock = Timeline(args.budget_s, args.points, out / "snapshots")
    split = {"generate_s": 0.0}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kwargs):
            if clock.start is None:
                clock.start = time.perf_counter()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **kwargs):
            step_s = time.perf_counter() - self.t0
            record = {"completions": args.prompts * args.group, "generate_s": split["generate_s"],
                      "train_s": step_s - split["generate_s"], "sync_s": 0.0, "reward": None}  # fmt: skip
            if clock.step_done(record, model.save_pretrained):
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, seed=0, report_to="none", use_vllm=False,
        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="grpo",
        scale_rewards="group", max_steps=1000000, logging_strategy="no", save_strategy="no",
        bf16=False, gradient_checkpointing=False, disable_tqdm=True, log_completions=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=load_model(args.sft_checkpoint), reward_funcs=[correctness],
                          args=config, train_dataset=data,
                          processing_class=load_tokenizer(args.sft_checkpoint), callbacks=[Clock()])  # fmt: skip
    generate = trainer._generate_and_score_completions  # timed for the generate/train split

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            split["generate_s"] = time.perf_counter() - t0

    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    return clock.result()


# ----- the common evaluator ------------------------------------------------------------------


def greedy_accuracy(
    model_dir: str, tok, prompts: list[tuple[list[int], str]], max_new: int
) -> float:
    """Held-out greedy exact-match accuracy of one snapshot (HF generate, left-padded batches)."""
    import torch

    from rollouts.tasks.arithmetic import is_correct
    from training.backend.pytorch import load_model

    model = load_model(model_dir).eval()
    correct = 0
    with torch.inference_mode():
        for k in range(0, len(prompts), 256):
            chunk = prompts[k : k + 256]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), width), tok.pad_token_id)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (p, _) in enumerate(chunk):
                ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
            texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
            correct += sum(is_correct(t, a) for t, (_, a) in zip(texts, chunk, strict=True))
    return correct / len(prompts)


def evaluate_all(runs: dict[str, list[dict]], args) -> float:
    """Fill in every snapshot's accuracy; returns the starting model's accuracy."""
    import torch

    from rollouts.prompts import encode_prompt
    from training.backend.pytorch import load_tokenizer

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.sft_checkpoint)
    lines = Path(args.eval_file).read_text().splitlines()[: args.eval_prompts]
    prompts = [(encode_prompt(tok, r["messages"]), r["answer"]) for r in map(json.loads, lines)]
    start = greedy_accuracy(args.sft_checkpoint, tok, prompts, args.max_new_tokens)
    for arm_runs in runs.values():
        for run in arm_runs:
            for snap in run["snapshots"]:
                snap["accuracy"] = greedy_accuracy(snap["path"], tok, prompts, args.max_new_tokens)
            shutil.rmtree(Path(run["snapshots"][0]["path"]).parent.parent, ignore_errors=True)
    return start


# ----- the side-by-side run ------------------------------------------------------------------


def sft_checkpoint(args) -> str:
    """The SFT'd tiny model: --sft-checkpoint, or the SFT recipe's output (run once if missing)."""
    if args.sft_checkpoint:
        return args.sft_checkpoint
    from training.backend.checkpoint import find_latest_checkpoint
    from training.config import SFTRunConfig, load_config
    from training.recipes.rl import sft_checkpoint_mismatch

    # smoke runs only need some model: a short SFT of their own keeps them fast
    out = harness.REPO / "runs" / "bench" / ("sft_tiny_quick" if args.quick else "sft_tiny")
    overrides = [f"output_dir={out}", f"model.tiny_dir={out.parent / 'tiny_model'}"]
    if args.quick:
        overrides.append("train.max_steps=100")
    sft = load_config(SFTRunConfig, SFT_CONFIG, overrides)
    latest = find_latest_checkpoint(out / "checkpoints")
    why = "is missing" if latest is None else sft_checkpoint_mismatch(latest, sft)
    if why is not None:
        print(f"SFT'd model in {out} {why}: running the SFT recipe ...", flush=True)
        subprocess.run([sys.executable, "examples/run_sft.py", "--config", str(SFT_CONFIG),
                        *overrides], cwd=harness.REPO, check=True)  # fmt: skip
        latest = find_latest_checkpoint(out / "checkpoints")
    return str(latest)


def summarise(runs: dict[str, list[dict]], start_acc: float, args) -> tuple[list, list[str]]:
    rows, notes = [], []
    fractions = [k / args.points for k in range(1, args.points + 1)]
    stats = {}
    for arm, arm_runs in runs.items():
        per_run = []
        for run in arm_runs:
            steps = run["steps"]
            durations = [b["t"] - a["t"] for a, b in itertools.pairwise(steps)][1:]
            total_t = steps[-1]["t"]
            per_run.append({
                "s_per_step": harness.median(durations) if durations else steps[-1]["t"],
                "completions_per_s": sum(s["completions"] for s in steps) / total_t,
                "n_steps": len(steps),
                "gen": harness.median(s["generate_s"] for s in steps[2:] or steps),
                "train": harness.median(s["train_s"] for s in steps[2:] or steps),
                "sync": harness.median(s["sync_s"] for s in steps[2:] or steps),
                "acc": [_acc_at(run["snapshots"], f * args.budget_s, start_acc) for f in fractions],
                "rss": run["rss_mb"],
            })  # fmt: skip
        med = {k: harness.median(r[k] for r in per_run) for k in per_run[0] if k != "acc"}
        med["acc"] = [harness.median(r["acc"][i] for r in per_run) for i in range(len(fractions))]
        stats[arm] = med
        rows.append([ARMS[arm], med["s_per_step"], med["completions_per_s"], med["n_steps"],
                     f"{med['gen']:.3f} / {med['train']:.3f} / {med['sync']:.3f}",
                     f"{start_acc:.1%}", *(f"{a:.1%}" for a in med["acc"])])  # fmt: skip
    if "trl" in stats:
        for arm in (a for a in stats if a != "trl"):
            rate = stats["trl"]["s_per_step"] / stats[arm]["s_per_step"]
            notes.append(f"- {ARMS[arm]} / TRL step rate: {harness.verdict(rate, 2.0)}; "
                         f"completions/s {stats[arm]['completions_per_s'] / stats['trl']['completions_per_s']:.2f}x")  # fmt: skip
            ahead = sum(a > b for a, b in zip(stats[arm]["acc"], stats["trl"]["acc"], strict=True))
            notes.append(f"- {ARMS[arm]} vs TRL accuracy at equal training time: ahead at "
                         f"{ahead} of {len(fractions)} points (final "
                         f"{stats[arm]['acc'][-1]:.1%} vs {stats['trl']['acc'][-1]:.1%})")  # fmt: skip
    return rows, notes


def _acc_at(snapshots: list[dict], t: float, start_acc: float) -> float:
    """Accuracy of the last snapshot taken at or before training time `t` (the point itself
    is taken at the first step end past it, so allow that step's overshoot)."""
    best = start_acc
    for s in snapshots:
        if s["t"] <= t * 1.05 + 0.5:
            best = s["accuracy"]
    return best


def plot(runs: dict[str, list[dict]], start_acc: float, args) -> Path | None:
    plt = harness.pyplot()
    if plt is None:
        return None
    colors = {"rollouts": "tab:green", "rollouts_2t": "tab:olive", "rollouts_overlap": "tab:blue",
              "trl": "tab:orange"}  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, arm_runs in runs.items():
        for i, run in enumerate(arm_runs):
            ts = [0.0] + [s["t"] for s in run["snapshots"]]
            accs = [start_acc] + [s["accuracy"] for s in run["snapshots"]]
            ax.plot(ts, [a * 100 for a in accs], marker="o", ms=3, color=colors[arm],
                    alpha=0.8, label=ARMS[arm] if i == 0 else None)  # fmt: skip
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel(f"held-out greedy accuracy (%), {args.eval_prompts} prompts")
    ax.set_title(f"GRPO on the SFT'd tiny model: {args.prompts} prompts x {args.group}, "
                 f"lr {args.lr}", fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    return harness.save_figure(fig, "grpo_learning", args.quick)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="rollouts,rollouts_overlap,rollouts_2t,trl",
                   help=f"comma-separated, of: {', '.join(ARMS)}")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=40.0,
                   help="training seconds per run (longer: e.g. 300)")  # fmt: skip
    p.add_argument("--points", type=int, default=6, help="snapshots (accuracy points) per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (rl_tiny: 16)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (rl_tiny: 8)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5, help="rl_tiny's learning rate")
    p.add_argument("--eval-prompts", type=int, default=500)
    p.add_argument("--threads", type=int, default=2, help="TRL's and the evaluator's threads")
    p.add_argument("--sft-checkpoint", help="starting model (default: the SFT recipe's output)")
    p.add_argument("--rollouts-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra dotted overrides of rl_tiny for the rollouts arms, "
                        "e.g. backend.num_threads=2")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smoke run: 10 s budget, 1 repeat")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--train-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        if args.one == "rollouts_overlap":  # both run at once: one core each
            args.rollouts_overrides += ["backend.num_threads=1", "engines.local_threads=1"]
        if args.one == "rollouts_2t":  # they take turns: all (2) cores to each
            args.rollouts_overrides += ["backend.num_threads=2", "engines.local_threads=2"]
        result = run_trl(args) if args.one == "trl" else run_rollouts(
            args, "overlap" if args.one == "rollouts_overlap" else "sync")  # fmt: skip
        harness.emit(result)
        return 0
    if args.quick:
        harness.apply_quick(args, p, budget_s=10.0, repeats=1, points=2, eval_prompts=100)
    started = time.time()
    args.sft_checkpoint = sft_checkpoint(args)
    from training.config import load_config
    from training.rl_config import RLRunConfig

    rl = load_config(RLRunConfig, RL_CONFIG, args.rollouts_overrides)
    files = rl.data.write_task_files()
    args.train_file, args.eval_file = str(files.rl_train), str(files.rl_eval)
    arms = args.arms.split(",")
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k in ("budget_s", "points", "prompts", "group", "max_new_tokens", "lr",
                            "threads", "sft_checkpoint", "train_file")]  # fmt: skip
    if args.rollouts_overrides:
        passthrough += ["--rollouts-overrides", *args.rollouts_overrides]
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.repeats):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            print(f"  [repeat {r + 1}/{args.repeats}] {arm} ...", flush=True)
            runs[arm].append(harness.run_child([__file__, "--one", arm, *passthrough]))
    start_acc = evaluate_all(runs, args)
    rows, notes = summarise(runs, start_acc, args)
    fr = [f"acc@{k * args.budget_s / args.points:.0f}s" for k in range(1, args.points + 1)]
    table = harness.md_table(["arm", "s/step", "completions/s", "steps", "gen / train / sync s",
                              "acc@0s", *fr], rows)  # fmt: skip
    print(f"\nGRPO learning speed (median of {args.repeats}; budget {args.budget_s:.0f} s)")
    print(table)
    print("\n".join(notes))
    png = plot(runs, start_acc, args)
    body = (
        f"Starting model: `{Path(args.sft_checkpoint).relative_to(harness.REPO) if Path(args.sft_checkpoint).is_relative_to(harness.REPO) else args.sft_checkpoint}`; "
        f"{args.prompts} prompts x {args.group} samples per step, at most {args.max_new_tokens} "
        f"new tokens, lr {args.lr} constant, {args.budget_s:.0f} s of training per run, "
        f"accuracy = greedy exact match on {args.eval_prompts} held-out prompts. rollouts: "
        f"trainer {rl.backend.num_threads} thread(s) + local engine {rl.engines.local_threads} "
        f"thread(s) (rl_tiny{' + ' + ' '.join(args.rollouts_overrides) if args.rollouts_overrides else ''}); "
        f"TRL: one process, {args.threads} threads. Accuracy columns are medians over repeats "
        "at equal training time.\n\n"
        f"{table}\n\n" + "\n".join(notes) + "\n\n" + harness.image_link(png, args.quick, "GRPO")
    )  # fmt: skip
    harness.write_section("grpo_learning", "GRPO learning speed vs TRL", body, quick=args.quick,
                          started=started)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
