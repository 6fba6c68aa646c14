"""Kernel launches per SFT step and per GRPO update, on CPU, at the GPU check's configuration:
today's trainer against each change of issue 43, side by side in one run.

Why on CPU: the H100 check's step is bound by the CPU issuing ~19,000 kernel-launching ops per
SFT step (~30,000 per GRPO update) while the GPU idles a third of the time (docs/gpus.md).
Which ops a step issues does not depend on the device or on the layer widths, so this script
counts them on CPU at the GPU check's structure (benchmarks/gpu_check.py): Qwen2.5-0.5B's
24 layers, 14 heads / 2 KV heads, tied embeddings, FSDP2 in a process group of one (gloo),
bf16 compute over fp32 master weights, fp32 reduce; narrowed to hidden 112, MLP 128 and a
4,096-token vocabulary, and with every length ÷ 8 (SFT: 64 samples of 64 tokens in rows of
256, micro-batches of 1,024 tokens = 4 per step; GRPO: 16 prompts × 8 samples, 16-token
prompts, 32-token responses, prompt-shared rows), so the micro-batch structure is the check's.
On CUDA the kernel count equals this count up to a few ops that are one kernel there and
several on CPU (FSDP's chunk_cat, per-tensor vs foreach AdamW): docs/gpus.md, "Launch counts".

A kernel-launching op is a leaf aten op (one with no aten op below it in the profiler's tree)
that computes or copies: views and metadata ops (`view`, `transpose`, `as_strided`, `detach`,
`empty`, ...) launch nothing and are not counted; each host sync (`_local_scalar_dense`) is a
device-to-host copy and is.

The variants are cumulative, each turning on one change through its config switch:
  today              model.attention=sdpa, fsdp.accumulate_unsharded=false, 1,024-token mbs
  +accumulate        fsdp.accumulate_unsharded (gather and cast once per op, one reduce)
  +segments          model.attention=segments (no 4D mask, no K/V expansion)
  +large micro-batch backend.micro_batch_tokens 4,096 (the check's 32k: one SFT micro-batch)
  +compile           fsdp.compile_layers (only with --compile: minutes of Inductor on CPU)

It also reports the largest float32 tensor of vocabulary width any op of the step reads
(`[rows, V]`), and whether one of (micro-batch tokens × V) elements exists: the vocabulary head
(helper `gpu-head`, training/data/packing.py) is what removes it.

    python benchmarks/launch_counts.py [--baseline] [--compile] [--layers N]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path

import plumbing.threads  # noqa: F401  (before torch: the project's OpenMP settings)

NARROW = dict(hidden_size=112, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, intermediate_size=128, vocab_size=4096,
              max_position_embeddings=4096, rope_theta=1_000_000.0)  # fmt: skip
# Ops that launch no kernel: views, metadata, allocation.
NO_KERNEL = frozenset(
    "aten::" + n
    for n in (
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "as_strided",
        "t",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "narrow",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "detach",
        "alias",
        "view_as",
        "empty",
        "empty_like",
        "empty_strided",
        "resize_",
        "set_",
        "lift_fresh",
        "diagonal",
        "numpy_T",
        "size",
        "stride",
        "result_type",
        "is_nonzero",
        "contiguous",
        "to",
        "type_as",
        "flatten",
        "unflatten",
        "movedim",
        "_has_compatible_shallow_copy_type",
        "is_same_size",
        "retain_grad",
        "requires_grad_",
        "_to_dense",
        "record_stream",
    )
)


@dataclass(frozen=True)
class Shape:
    layers: int = 24
    sft_samples: int = 64
    sft_sample_len: int = 64
    pack_length: int = 256
    micro_batch_tokens: int = 1024
    large_micro_batch_tokens: int = 4096
    rl_prompts: int = 16
    rl_group: int = 8
    prompt_len: int = 16
    response_len: int = 32


@dataclass(frozen=True)
class Variant:
    name: str
    attention: str = "sdpa"
    accumulate: bool = False
    large_micro_batches: bool = False
    auto_micro_batches: bool = False  # backend.micro_batch_tokens: auto (the GPU check's row)
    compile_layers: bool = False


VARIANTS = (
    Variant("today"),
    Variant("+accumulate", accumulate=True),
    Variant("+segments", "segments", accumulate=True),
    Variant("+large micro-batch", "segments", accumulate=True, large_micro_batches=True),
    Variant("+compile", "segments", True, True, compile_layers=True),
)


def launching_ops(prof) -> dict[str, int]:
    """{op name: calls} of the leaf aten ops that launch a kernel (see the docstring)."""
    counts: dict[str, int] = {}
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in NO_KERNEL:
            continue
        if any(c.name.startswith("aten::") for c in e.cpu_children):
            continue
        counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def largest_fp32_vocab_rows(prof, vocab: int) -> int:
    """The most rows of any float32 [..., vocab] tensor an op of the step read (0: none)."""
    rows = 0
    for e in prof.events():
        for shape, dtype in zip(e.input_shapes or (), e.input_dtypes or (), strict=False):
            if dtype == "float" and shape and shape[-1] == vocab:
                rows = max(rows, math.prod(shape[:-1]))
    return rows


def rl_batch(shape: Shape, rng: random.Random, vocab: int):
    from rollouts.types import RolloutBatch, Sample

    groups = []
    for g in range(shape.rl_prompts):
        prompt = tuple(rng.randrange(5, vocab) for _ in range(shape.prompt_len))
        group = []
        for i in range(shape.rl_group):
            resp = tuple(rng.randrange(5, vocab) for _ in range(shape.response_len))
            sample = Sample(prompt, resp, (1,) * len(resp), group_id=g, index_in_group=i)
            group.append(sample.with_reward(sum(t % 2 == 0 for t in resp) / len(resp)))
        groups.append(tuple(group))
    return RolloutBatch(tuple(groups), 0, 0)


async def measure(variant: Variant, shape: Shape, model_dir: Path, tmp: Path) -> dict:
    """One warm-up and one profiled SFT step, then the same for a GRPO update."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.config import OptimConfig
    from training.data.tokenize import TokenizedSample
    from training.distributed import current
    from training.rl.algorithms import grpo
    from training.rl.batch import collate_rl
    from training.rl.step import train_on_batch

    ctx = current()
    assert ctx is not None and ctx.world == 1, "expected a process group of one"
    ctx.fsdp = ctx.fsdp.model_copy(update={"accumulate_unsharded": variant.accumulate,
                                           "compile_layers": variant.compile_layers})  # fmt: skip
    tok = load_tokenizer(model_dir)
    vocab = NARROW["vocab_size"]
    mbt = (
        shape.large_micro_batch_tokens if variant.large_micro_batches else shape.micro_batch_tokens
    )
    build = partial(load_model, str(model_dir), attention=variant.attention)
    optim = OptimConfig(lr=1e-5, schedule="constant")
    out: dict = {}

    def profiled():
        return profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                       experimental_config=_ExperimentalConfig(profile_all_threads=True))  # fmt: skip

    sft = PyTorchTrainingBackend(build, tok, optim=optim, max_steps=10, checkpoint_dir=tmp / "sft",
                                 pack_length=shape.pack_length, micro_batch_tokens=mbt)  # fmt: skip
    for _ in range(2):  # the same batch: the warm-up's weights change, the ops do not
        rng = random.Random(1)
        n = shape.sft_sample_len
        batch = [TokenizedSample(tuple(rng.randrange(5, vocab) for _ in range(n)),
                                 (0,) * 8 + (1,) * (n - 8), "launch_counts")
                 for _ in range(shape.sft_samples)]  # fmt: skip
        with profiled() as prof:
            fb = sft.forward_backward(batch)
            step = await sft.optim_step().result()
            metrics = await fb.result()
    out["sft"] = {"launches": sum(launching_ops(prof).values()), "loss": metrics["loss"],
                  "grad_norm": step["grad_norm"], "n_microbatches": metrics["n_microbatches"],
                  "fp32_vocab_rows": largest_fp32_vocab_rows(prof, vocab),
                  "mb_tokens": mbt, "top": _top(launching_ops(prof))}  # fmt: skip
    sft.close()
    del sft

    rl = PyTorchTrainingBackend(build, tok, optim=optim, max_steps=10, checkpoint_dir=tmp / "rl",
                                pack_length=None, micro_batch_tokens=mbt,
                                collate_fn=partial(collate_rl, pad_id=tok.pad_token_id))  # fmt: skip
    for _ in range(2):
        batch = rl_batch(shape, random.Random(2), vocab)
        with profiled() as prof:
            metrics = await train_on_batch(rl, batch, grpo(), temperature=1.0,
                                           old_from_rollout=False, reference=None)  # fmt: skip
    out["grpo"] = {"launches": sum(launching_ops(prof).values()), "loss": metrics["loss"],
                   "grad_norm": metrics["grad_norm"],
                   "n_microbatches": metrics.get("n_microbatches"),
                   "fp32_vocab_rows": largest_fp32_vocab_rows(prof, vocab),
                   "mb_tokens": mbt, "top": _top(launching_ops(prof))}  # fmt: skip
    rl.close()
    return out


def _top(counts: dict[str, int], n: int = 8) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:n])


def run(variants: list[Variant], shape: Shape) -> dict:
    import gc

    import trio

    from engines.launch import find_free_port
    from training.config import BackendConfig, FSDPConfig
    from training.distributed import run_rank0

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check import build_model_dir

    for key, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(find_free_port()))):  # fmt: skip
        os.environ.setdefault(key, value)
    fsdp = FSDPConfig(at_world_size_1=True, param_dtype="bfloat16", reduce_dtype="float32")

    def main() -> dict:
        results = {}
        with tempfile.TemporaryDirectory(prefix="launch_counts_") as tmp:
            model_dir = build_model_dir(
                Path(tmp) / "model", {**NARROW, "num_hidden_layers": shape.layers}
            )
            for v in variants:
                t0 = time.perf_counter()
                results[v.name] = trio.run(measure, v, shape, model_dir, Path(tmp) / v.name)
                results[v.name]["wall_s"] = time.perf_counter() - t0
                gc.collect()
        return results

    result = run_rank0(BackendConfig(num_threads=1, fsdp=fsdp), main)
    assert result is not None
    return result


def report(results: dict, shape: Shape) -> str:
    base = next(iter(results.values()))
    rows = []
    for name, r in results.items():
        row = [name]
        for phase in ("sft", "grpo"):
            f, b = r[phase], base[phase]
            row += [f["n_microbatches"], f["launches"], f"{100 * f['launches'] / b['launches']:.0f} %",
                    f"{f['loss']:.5f}", f"{f['grad_norm']:.5f}"]  # fmt: skip
        rows.append(row)
    table = harness.md_table(["variant", "SFT mbs", "SFT launches", "of today", "SFT loss",
                              "SFT grad norm", "GRPO mbs", "GRPO launches", "of today",
                              "GRPO loss", "GRPO grad norm"], rows)  # fmt: skip
    vocab = NARROW["vocab_size"]
    lines = []
    for name, r in results.items():
        for phase in ("sft", "grpo"):
            f = r[phase]
            full = f["fp32_vocab_rows"] >= f["mb_tokens"]
            lines.append(f"- {name}, {phase}: largest float32 [rows, {vocab}] tensor: "
                         f"{f['fp32_vocab_rows']:,} rows; one of (micro-batch tokens × V) "
                         f"elements: {'yes' if full else 'no'}")  # fmt: skip
    return (f"Launch counts at {shape.layers} layers (CPU replica of benchmarks/gpu_check.py)\n\n"
            f"{table}\n\n" + "\n".join(lines))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", action="store_true", help="today's configuration only")
    p.add_argument("--compile", action="store_true", help="also the compiled variant (slow)")
    p.add_argument("--layers", type=int, default=24, help="decoder layers (the check's: 24)")
    p.add_argument("--quick", action="store_true",
                   help="lengths ÷ 4 more (the test's size); counts then differ from the check's")  # fmt: skip
    args = p.parse_args()
    shape = Shape(layers=args.layers)
    if args.quick:
        shape = replace(shape, sft_samples=16, sft_sample_len=24, pack_length=64,
                        micro_batch_tokens=256, large_micro_batch_tokens=1024, rl_prompts=4,
                        rl_group=4, prompt_len=6, response_len=8)  # fmt: skip
    chosen = VARIANTS[:1] if args.baseline else [
        v for v in VARIANTS if args.compile or not v.compile_layers]  # fmt: skip
    results = run(list(chosen), shape)
    print(report(results, shape))
    harness.emit({name: {ph: {k: v for k, v in f.items() if k != "top"} for ph, f in r.items()
                         if isinstance(f, dict)} for name, r in results.items()})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
