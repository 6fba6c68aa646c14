"""Weight sync: disk (export + sync) and distributed (broadcast) to 1 and 2 local engines, vs save
+ load by hand.

For each model size, two local engines (`python -m engines.local`, 1 torch thread each: two
of them share the 2 cores) serve the model, and a `PyTorchTrainingBackend` holds the trainer's
copy.
Alternating in every repeat:
- ours, 1 engine:  `backend.export_weights(dir)` (HF layout: safetensors + config + tokenizer,
  on the trainer's worker thread) then `sync_weights_to_engines([engine], dir, version)`
  (pause → /update_weights_from_disk → /get_model_info check → continue), i.e. exactly what
  the RL loop's `push_weights` does every `sync_every` steps;
- ours, 2 engines: the same, to both engines concurrently;
- distributed, 1 and 2 engines: `push_weights(..., refit=group)`, SGLang's refit protocol
  (`engines.weight_transport: distributed`): pause → begin_weight_update → the weights
  broadcast over a gloo group in 512 MiB buckets while each engine's
  /update_weights_from_distributed receives them → end → version check → continue; nothing
  is written (the group is formed once, before the timed repeats, as in a run);
- raw: `model.save_pretrained(dir)` + `AutoModelForCausalLM.from_pretrained(dir)` in one
  process: the least any disk-based handover can cost.
The target (<= 1.3x) compares ours to raw; distributed vs disk is the ratio of those two paths
in the same repeat. Sizes: tiny (3 M), small (26 M) and `0.5b`, a model with Qwen2.5-0.5B's
shapes (494 M parameters, tied embeddings) and random weights (fewer repeats: 2 GB a copy). A breakdown shows where our time goes: the export
(model and tokenizer separately), the server-side load as the engine logs it, and the HTTP
control calls (pause + model_info + continue).

    .venv/bin/python benchmarks/weight_sync.py [--sizes tiny,small,0.5b] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
import torch
import trio

from engines import SGLangEngine, launch_engine
from engines.refit import RefitGroup
from engines.weight_sync import sync_weights_to_engines
from training.backend.checkpoint import export_hf
from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
from training.backend.tiny_model import build_tiny_model
from training.config import OptimConfig
from training.loops.weight_push import push_weights

SIDES = {
    "ours_1": "disk: export + sync_weights_to_engines, 1 engine",
    "ours_2": "disk: export + sync_weights_to_engines, 2 engines",
    "dist_1": "distributed: broadcast (gloo), 1 engine",
    "dist_2": "distributed: broadcast (gloo), 2 engines",
    "raw": "save_pretrained + from_pretrained",
}
REPEATS_CAP = {"0.5b": 2}  # 2 GB a copy on 2 cores: each repeat takes minutes


def build_model(out: Path, size: str) -> Path:
    """The tiny/small test models, or `0.5b`: Qwen2.5-0.5B's shapes with random weights and
    the tiny model's tokenizer (a weight push does not read the tokenizer's vocabulary)."""
    if size != "0.5b":
        return build_tiny_model(out, seed=0, size=size)
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tiny = build_tiny_model(out.with_name("tokenizer_src"), seed=0, size="tiny")
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


def raw_roundtrip(model: torch.nn.Module, out: Path) -> float:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model.save_pretrained(out)
    AutoModelForCausalLM.from_pretrained(out)
    return time.perf_counter() - t0


def engine_load_times(log: Path) -> list[float]:
    """Server-side load durations the local engine logged ("updated weights ... in X s")."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [float(x) for x in re.findall(r"updated weights from .* in ([0-9.]+) s", text)]


async def measure_size(size: str, args, tmp: Path) -> dict:
    model_dir = build_model(tmp / size, size)
    tok = load_tokenizer(model_dir)
    backend = PyTorchTrainingBackend(
        lambda: load_model(model_dir), tok, optim=OptimConfig(), max_steps=1,
        checkpoint_dir=tmp / "ckpt", num_threads=1,
    )  # fmt: skip
    n_params = sum(p.numel() for p in backend.model.parameters())
    extra = ["--num-threads", "1", "--weight-version", "0"]
    times: dict[str, list[float]] = {k: [] for k in [*SIDES, "export", "export_model",
                                                     "export_tokenizer", "control"]}  # fmt: skip
    logs = [tmp / f"{size}_engine_{i}.log" for i in range(2)]
    version = 0
    with backend:
        async with (
            launch_engine(kind="local", model_path=model_dir, extra_args=extra,
                          log_path=logs[0]) as l0,
            launch_engine(kind="local", model_path=model_dir, extra_args=extra,
                          log_path=logs[1]) as l1,
            SGLangEngine(l0.url) as e0,
            SGLangEngine(l1.url) as e1,
        ):  # fmt: skip
            groups = {"dist_1": (RefitGroup(), [e0]), "dist_2": (RefitGroup(), [e0, e1])}
            for group, engines in groups.values():  # formed once, as in a run
                await push_weights(backend, engines, tmp / "dist", refit=group)
            n = len(SIDES)
            for r in range(min(args.repeats, REPEATS_CAP.get(size, args.repeats))):
                for side in list(SIDES)[r % n :] + list(SIDES)[: r % n]:
                    version += 1
                    out = tmp / f"{size}_v{version:04d}"
                    t0 = time.perf_counter()
                    if side == "raw":
                        times[side].append(await trio.to_thread.run_sync(
                            raw_roundtrip, backend.model, out))  # fmt: skip
                        continue
                    if side in groups:
                        group, engines = groups[side]
                        await push_weights(backend, engines, tmp / "dist", refit=group)
                        times[side].append(time.perf_counter() - t0)
                        continue
                    path = await backend.export_weights(out)
                    t1 = time.perf_counter()
                    engines = [e0] if side == "ours_1" else [e0, e1]
                    await sync_weights_to_engines(engines, path, str(version))
                    times[side].append(time.perf_counter() - t0)
                    times["export"].append(t1 - t0)
                # the parts, measured apart: model vs tokenizer save, HTTP control round trips
                t0 = time.perf_counter()
                await backend.call(lambda o=tmp / f"{size}_m{r}": export_hf(backend.model, None, o)).result()  # fmt: skip
                times["export_model"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await trio.to_thread.run_sync(tok.save_pretrained, tmp / f"{size}_t{r}")
                times["export_tokenizer"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await e0.pause("abort")
                await e0.model_info()
                await e0.resume()
                times["control"].append(time.perf_counter() - t0)
            for group, _ in groups.values():
                await group.close()
    if (tmp / "dist").exists() and any((tmp / "dist").iterdir()):
        raise RuntimeError("a distributed push wrote weights to disk (an engine left the group?)")
    loads = engine_load_times(logs[0]) + engine_load_times(logs[1])
    return {"times": times, "server_load": loads, "n_params": n_params,
            "bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,small,0.5b")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 repeat")
    args = p.parse_args()
    if args.quick:
        harness.apply_quick(args, p, sizes="tiny", repeats=1)
    torch.set_num_threads(1)
    started = time.time()
    rows, notes = [], []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            res = trio.run(measure_size, size, args, Path(tmp))
        med = {k: harness.median(v) for k, v in res["times"].items()}
        # Each repeat times every path back to back, so the ratio is taken per repeat and then
        # the median: a machine that slows down between repeats shifts all paths of a repeat.
        ratio = {side: harness.median([a / b for a, b in zip(res["times"][side], res["times"]["raw"],
                                                            strict=True)]) for side in SIDES}  # fmt: skip
        vs_disk = {k: harness.median([a / b for a, b in zip(res["times"][f"dist_{k}"],
                                                            res["times"][f"ours_{k}"], strict=True)])
                   for k in (1, 2)}  # fmt: skip
        for side in SIDES:
            rows.append([size, SIDES[side], med[side] * 1000, ratio[side],
                         ", ".join(f"{v * 1000:.0f}" for v in res["times"][side])])  # fmt: skip
        server = harness.median(res["server_load"])
        notes.append(
            f"- {size}: distributed / disk, same repeat (median): 1 engine {vs_disk[1]:.2f}x, "
            f"2 engines {vs_disk[2]:.2f}x ({med['dist_1'] * 1000:.0f} vs {med['ours_1'] * 1000:.0f}"
            f" ms, {med['dist_2'] * 1000:.0f} vs {med['ours_2'] * 1000:.0f} ms); nothing written "
            "by the distributed pushes."
        )  # fmt: skip
        notes.append(
            f"- {size} ({res['n_params'] / 1e6:.1f} M parameters, {res['bytes'] / 2**20:.0f} MiB "
            f"safetensors): 1 engine {harness.verdict(ratio['ours_1'], 1.3, higher_is_better=False)}, "
            f"2 engines {harness.verdict(ratio['ours_2'], 1.3, higher_is_better=False)} (median of "
            "per-repeat ratios). "
            f"Where the 1-engine time goes: export {med['export'] * 1000:.0f} ms (model "
            f"{med['export_model'] * 1000:.0f} ms, tokenizer {med['export_tokenizer'] * 1000:.0f} ms), "
            f"server-side load {server * 1000:.0f} ms, pause + model_info + continue "
            f"{med['control'] * 1000:.0f} ms (idle engine; on SGLang 0.5.23 a pause \"abort\" "
            "with requests in flight takes >= 1 s: its tokenizer manager re-checks every 1 s "
            "until they are gone), the rest (HTTP of the update call, scheduling) "
            f"{(med['ours_1'] - med['export'] - server - med['control']) * 1000:.0f} ms."
        )  # fmt: skip
    notes.append(
        "- Reading distributed vs disk: on one CPU machine the disk path goes through the page "
        "cache (safetensors written, then read back by each engine), while a broadcast moves "
        "every byte through loopback TCP (gloo sends to each engine in turn) plus a flatten copy "
        "on each side; so disk stays the default wherever a filesystem is shared. Distributed is "
        "for engines on other hosts (no shared filesystem) and NCCL between GPUs."
    )
    table = harness.md_table(["model", "path", "ms (median)", "vs raw (per repeat, median)",
                              f"runs (ms, {args.repeats} repeats)"], rows)  # fmt: skip
    harness.publish("weight_sync", "Weight sync vs save + load by hand", "Weight sync",
                    [table], notes, quick=args.quick, started=started)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
