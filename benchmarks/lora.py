"""LoRA vs full fine-tuning: SFT accuracy and trainer memory, RL weight-push bytes and time.

SFT (issue 17's "must show" 2): the SFT recipe (`configs/sft_tiny.yaml`: arithmetic, packed
rows, cosine schedule) on the tiny and small models, the same steps and data for every side:
- full             every weight trained, the recipe's lr
- lora r=R         `model.lora.rank=R` (alpha 2R, all linear layers), the recipe's lr
- lora r=R, lr xK  the same with K times the lr (LoRA is usually run with a larger lr)
Held-out greedy accuracy is the recipe's own (`train.greedy_eval_samples` prompts of the RL
held-out split, exact match); peak RSS is the trainer process's (each side runs in a fresh
child process, so it is that side's alone). A 3 M model may learn worse with LoRA: the table
says what was measured.

RL push (must show 1): what the RL loop does every `sync_every` steps, `push_weights`
(export + pause + load on the engine + verify the version + continue), for a full model on a
plain local engine and for a rank-R adapter on a local engine started with the LoRA flags
(`--enable-lora ...`, `/load_lora_adapter` of `policy-v<N>`, older versions unloaded beyond
`keep`). Each repeat trains one untimed step on both sides, then times both pushes in
alternating order. Bytes = the files written per push.

    .venv/bin/python benchmarks/lora.py [--sft-sizes tiny,small] [--push-sizes tiny,small]
        [--steps 800] [--greedy 500] [--rank 8] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path

import plumbing.threads  # noqa: F401  (before torch: the project's OpenMP settings)


def sft_sides(rank: int, lr_factor: float) -> dict[str, list[str]]:
    """Side name → extra overrides of the SFT recipe."""
    return {
        "full": [],
        f"lora r={rank}": [f"model.lora.rank={rank}"],
        f"lora r={rank}, lr x{lr_factor:g}": [f"model.lora.rank={rank}", f"LRx{lr_factor}"],
    }


# ----- one SFT run per child process ------------------------------------------------------------


def sft_child(size: str, steps: int, greedy: int, overrides: list[str], out: str) -> dict:
    import trio

    from training.config import SFTRunConfig, load_config
    from training.recipes.sft import run_sft_recipe

    base = load_config(SFTRunConfig, harness.REPO / "configs" / "sft_tiny.yaml")
    extra = []
    for item in overrides:  # `LRx<k>`: k times the recipe's lr
        extra.append(f"optim.lr={base.optim.lr * float(item[3:])}" if item.startswith("LRx")
                     else item)  # fmt: skip
    config = load_config(SFTRunConfig, harness.REPO / "configs" / "sft_tiny.yaml", [
        f"output_dir={out}", f"model.tiny_size={size}", f"model.tiny_dir=runs/tiny_model_{size}",
        f"train.max_steps={steps}", f"train.checkpoint_every={steps}", f"train.eval_every={steps}",
        f"train.log_every={max(1, steps // 4)}", f"train.greedy_eval_samples={greedy}", *extra,
    ])  # fmt: skip
    t0 = time.perf_counter()
    summary = trio.run(run_sft_recipe, config)
    wall = time.perf_counter() - t0
    ckpt = summary.checkpoint
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt else 0
    return {"accuracy": summary.accuracy, "eval_loss": summary.eval_loss,
            "final_loss": summary.final_loss, "wall_s": wall, "lr": config.optim.lr,
            "rss_mb": harness.peak_rss_mb_self(), "checkpoint_bytes": ckpt_bytes}  # fmt: skip


def measure_sft(args) -> tuple[list[list], list[str]]:
    rows, notes = [], []
    sides = sft_sides(args.rank, args.lr_factor)
    for size in [s for s in args.sft_sizes.split(",") if s]:
        results: dict[str, dict] = {}
        for name, overrides in sides.items():
            with tempfile.TemporaryDirectory() as tmp:
                results[name] = harness.run_child([
                    str(Path(__file__).resolve()), "--child-sft", size, str(args.steps),
                    str(args.greedy), json.dumps(overrides), str(Path(tmp) / "run"),
                ], timeout_s=4 * 3600)  # fmt: skip
            r = results[name]
            print(f"{size} {name}: {r}", flush=True)
            accuracy = float("nan") if r["accuracy"] is None else r["accuracy"] * 100
            rows.append([size, name, r["lr"], accuracy, r["eval_loss"],
                         r["rss_mb"], r["checkpoint_bytes"] / 2**20, r["wall_s"]])  # fmt: skip
        full, lora = results["full"], results[f"lora r={args.rank}"]
        reached = ""
        if full["accuracy"] is not None:
            reached = (f"LoRA r={args.rank} at the recipe's lr reaches "
                       f"{lora['accuracy'] * 100:.1f} % held-out vs {full['accuracy'] * 100:.1f} "
                       f"% full after {args.steps} steps; ")  # fmt: skip
        notes.append(
            f"- {size}: {reached}trainer peak RSS {lora['rss_mb']:.0f} vs "
            f"{full['rss_mb']:.0f} MiB ({lora['rss_mb'] / full['rss_mb']:.2f}x); last checkpoint "
            f"{lora['checkpoint_bytes'] / 2**20:.2f} vs {full['checkpoint_bytes'] / 2**20:.1f} MiB."
        )
    return rows, notes


# ----- RL weight push, LoRA vs full, in this process --------------------------------------------


async def measure_push(size: str, args, tmp: Path) -> dict:
    from functools import partial

    import httpx

    from engines import LoraLaunch, SGLangEngine, launch_engine
    from rollouts.tasks.arithmetic import make_problems
    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.backend.tiny_model import ensure_tiny_model
    from training.config import LoraSettings, OptimConfig
    from training.data.tokenize import tokenize_conversation
    from training.loops.weight_push import push_weights

    model_dir = ensure_tiny_model(harness.REPO / f"runs/tiny_model_{size}", size=size)
    tok = load_tokenizer(model_dir)
    samples = [tokenize_conversation(tok, p.sft_record()["messages"])
               for p in make_problems(8, seed=0)]  # fmt: skip
    lora = LoraSettings(rank=args.rank)

    def backend(side: str) -> PyTorchTrainingBackend:
        return PyTorchTrainingBackend(
            partial(load_model, str(model_dir)), tok, optim=OptimConfig(lr=1e-4),
            max_steps=10**6, checkpoint_dir=tmp / side / "ckpt", num_threads=1,
            lora=lora if side == "lora" else None,
        )  # fmt: skip

    backends = {side: backend(side) for side in ("full", "lora")}
    times: dict[str, list[float]] = {"full": [], "lora": []}
    sizes: dict[str, list[int]] = {"full": [], "lora": []}
    extra = ["--num-threads", "1", "--weight-version", "0"]
    flags = LoraLaunch(max_lora_rank=args.rank, max_loras_per_batch=lora.keep + 1)
    async with (
        launch_engine(kind="local", model_path=model_dir, extra_args=extra,
                      log_path=tmp / "full_engine.log") as plain,
        launch_engine(kind="local", model_path=model_dir, extra_args=extra, lora=flags,
                      log_path=tmp / "lora_engine.log") as adapters,
        SGLangEngine(plain.url) as e_full,
        SGLangEngine(adapters.url) as e_lora,
    ):  # fmt: skip
        engines = {"full": e_full, "lora": e_lora}
        for r in range(args.repeats):
            for side in ("full", "lora") if r % 2 == 0 else ("lora", "full"):
                trainer = backends[side]
                await trainer.forward_backward(samples).result()
                await trainer.optim_step().result()
                root = tmp / side / "weights"
                times[side].append(await push_weights(trainer, [engines[side]], root))
                newest = sorted(root.glob("v*"))[-1]
                sizes[side].append(sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()))
        async with httpx.AsyncClient(base_url=adapters.url, timeout=30) as http:
            cards = (await http.get("/v1/models")).json()["data"]
        loaded = sorted(c["id"] for c in cards if c.get("parent"))  # adapters, not the base
    for trainer in backends.values():
        trainer.close()
    n_params = sum(p.numel() for p in backends["full"].model.parameters())
    return {"times": times, "bytes": sizes, "n_params": n_params, "active": e_lora.active_lora,
            "loaded": loaded}  # fmt: skip


def push_table(args) -> tuple[list[list], list[str]]:
    import trio

    rows, notes = [], []
    for size in [s for s in args.push_sizes.split(",") if s]:
        with tempfile.TemporaryDirectory() as tmp:
            res = trio.run(measure_push, size, args, Path(tmp))
        med = {side: harness.median(v) for side, v in res["times"].items()}
        nbytes = {side: harness.median(v) for side, v in res["bytes"].items()}
        for side, label in (("full", "full weights (update_weights_from_disk)"),
                            ("lora", f"LoRA r={args.rank} adapter (load_lora_adapter)")):  # fmt: skip
            rows.append([size, label, nbytes[side] / 2**10, med[side] * 1000,
                         ", ".join(f"{v * 1000:.0f}" for v in res["times"][side])])  # fmt: skip
        notes.append(
            f"- {size} ({res['n_params'] / 1e6:.1f} M parameters): a LoRA push writes "
            f"{nbytes['lora'] / 2**10:.0f} KiB vs {nbytes['full'] / 2**10:.0f} KiB "
            f"({nbytes['full'] / nbytes['lora']:.0f}x less) and takes {med['lora'] * 1000:.0f} ms "
            f"vs {med['full'] * 1000:.0f} ms ({med['lora'] / med['full']:.2f}x the full push's "
            "time); the engine ends "
            f"serving {res['active']} with {', '.join(res['loaded'])} loaded (keep 2)."
        )
    return rows, notes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft-sizes", default="tiny,small", help="models for the SFT comparison")
    p.add_argument("--push-sizes", default="tiny,small", help="models for the push comparison")
    p.add_argument("--steps", type=int, default=800, help="SFT steps, every side (the recipe's)")
    p.add_argument("--greedy", type=int, default=500, help="held-out prompts for accuracy")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr-factor", type=float, default=5.0, help="the third side's lr multiple")
    p.add_argument("--repeats", type=int, default=5, help="weight pushes per side")
    p.add_argument("--section", default="lora", help="RESULTS.md section (key) to write")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny, 20 steps, 1 repeat")
    p.add_argument("--child-sft", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_sft:
        size, steps, greedy, overrides, out = args.child_sft
        harness.emit(sft_child(size, int(steps), int(greedy), json.loads(overrides), out))
        return 0
    if args.quick:
        harness.apply_quick(args, p, sft_sizes="tiny", push_sizes="tiny", steps=20, greedy=50,
                            repeats=1)  # fmt: skip
    started = time.time()
    parts, notes = [], []
    if args.sft_sizes:
        rows, sft_notes = measure_sft(args)
        parts += [f"SFT recipe (`configs/sft_tiny.yaml`), {args.steps} steps of 32 samples, "
                  f"held-out greedy accuracy on {args.greedy} prompts.",
                  harness.md_table(["model", "side", "lr", "held-out acc %", "eval loss",
                                    "peak RSS MiB", "checkpoint MiB", "wall s"], rows)]  # fmt: skip
        notes += sft_notes
    if args.push_sizes:
        rows, push_notes = push_table(args)
        parts += [f"RL weight push (`push_weights`, 1 local engine each, {args.repeats} repeats).",
                  harness.md_table(["model", "push", "KiB per push", "ms (median)",
                                    f"runs (ms, {args.repeats} repeats)"], rows)]  # fmt: skip
        notes += push_notes
    title = "LoRA vs full fine-tuning (issue 17)"
    if args.section != "lora":
        title += f": {args.sft_sizes or '-'} SFT, {args.push_sizes or '-'} push"
    harness.publish(args.section, title, "LoRA", parts, notes, quick=args.quick,
                    started=started)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
