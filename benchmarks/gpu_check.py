"""GPU check: SFT and GRPO in bf16 on a Qwen2.5-0.5B-shaped model, FSDP2 over NCCL, the local
engine on CUDA serving the same model, and a weight sync — one command on a GPU machine.

What runs (the project's own parts, nothing mocked):
- a Qwen2 model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
  vocabulary 151,936, tied embeddings) built here with random weights (the machine has no
  network), saved in HF layout with the project's tokenizer;
- `PyTorchTrainingBackend`s sharded with FSDP2 in a process group of one (NCCL;
  `fsdp.at_world_size_1`), bf16 compute over fp32 master weights (`fsdp.param_dtype`);
- SFT steps on packed rows, then GRPO steps (`train_on_batch`, `grpo()`) on groups the local
  engine (`python -m engines.local --device cuda --dtype bfloat16`) sampled, each followed by a
  weight sync (`push_weights`: the export and engine load the RL loop does after a step).

It prints step time, tokens/s, MFU against the GPU's dense bf16 peak and peak memory per phase,
then one row per trainer-speed change of issue 43 (benchmarks/gpu_variants.py: today,
+accumulate, +segments, +large micro-batch, +compile, on the same batches, with MFU by hardware
FLOPs too, the GPU-busy share, loss and grad norm), then the peer's row
(benchmarks/gpu_peer.py: a plain PyTorch SFT loop as a strong peer writes it, on the same model,
batches and GPU) and `ours / peer` tokens/s, ours being the project's fastest SFT row (issue 43
asks for ≥ 1.3×), and writes the `gpu_check` section of benchmarks/RESULTS.md.

Time budget (`--budget-s`, default 540 s on a GPU: one 10-minute device call with room to
start): the most valuable rows run first — SFT, GRPO with the engine (its batches are the
variants'), +large micro-batch, the peer, the other changes, fused AdamW, +compile last. Before
each of these optional rows the script estimates its cost from the rows measured so far; one
that would not fit is skipped, its cell says `skipped: time budget`, and the script still exits
0. Each finished row prints one line at once (flushed), so a run that is killed still shows
what it measured.

MFU counts the model's FLOPs as PaLM's appendix B does: 6·N per token for the N weights that
multiply (the output layer included, the embedding lookup not) plus 12·layers·hidden·T for
attention over each sample's T tokens.

`--dry-run` runs the same code on CPU at tiny size (fp32, gloo; the "peak" is a measured fp32
matmul rate), writing to benchmarks/results/quick/ unless `--results` says where; make test runs
it (tests/test_gpu_check.py), so it cannot rot. DEVELOPERS.md says how to carry the
dependencies to a GPU machine without network.

    python benchmarks/gpu_check.py [--dry-run] [--results PATH] [--profile PATH] [--budget-s S]

On the workplace's device tool, in one call: benchmarks/gpu_device_run.sh.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import harness  # benchmarks/harness.py: this script's folder is on sys.path
from gpu_budget import Budget, failed, optional_row, progress
from gpu_peer import peer_row, peer_table, ratio, ratio_line
from gpu_variants import AUTO, GPU_VARIANTS, busy_share, variant_row, variant_table

import plumbing.threads  # noqa: F401  (before torch: the project's OpenMP settings)

# Dense bf16 peak (TFLOP/s, no sparsity) by device name, from NVIDIA's datasheets; the first
# substring that matches wins.
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                max_position_embeddings=32768, rope_theta=1_000_000.0)  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=512)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the real check, or the dry run."""

    device: str
    param_dtype: str  # compute dtype (FSDP mixed precision); master weights stay fp32
    engine_dtype: str
    shape: dict
    sft_steps: int
    sft_sample_len: int
    sft_samples: int  # per step
    pack_length: int
    rl_steps: int
    rl_prompts: int
    rl_group: int
    prompt_len: int
    response_len: int
    micro_batch_tokens: int
    warmup: int  # steps of each phase left out of the figures


GPU = Plan("cuda", "bfloat16", "bfloat16", QWEN_05B, sft_steps=6, sft_sample_len=512,
           sft_samples=64, pack_length=2048, rl_steps=4, rl_prompts=16, rl_group=8,
           prompt_len=128, response_len=256, micro_batch_tokens=8192, warmup=1)  # fmt: skip
DRY = Plan("cpu", "bfloat16", "bfloat16", TINY, sft_steps=3, sft_sample_len=24, sft_samples=8,
           pack_length=64, rl_steps=2, rl_prompts=2, rl_group=4, prompt_len=8, response_len=8,
           micro_batch_tokens=512, warmup=1)  # fmt: skip


# A compile's rough cost on CUDA (the estimate before the peer's and +compile's rows), and the
# seconds kept after the last row for the report and the teardown.
COMPILE_S = 60.0
RESERVE_S = 20.0

# The phases the check measures: (key in the figures, row label in the table).
PHASES = (("sft", "SFT step"), ("sft_fused", "SFT step, fused AdamW"), ("grpo", "GRPO update"))


def build_model_dir(out: Path, shape: dict) -> Path:
    """A Qwen2 model of `shape` with random weights (seed 0) and the project's tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from training.backend.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(**shape, tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def matmul_params(shape: dict) -> int:
    """Weights that multiply activations: all but the embedding lookup, plus the (tied) output
    layer, which is a matmul of vocabulary × hidden."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return body + shape["vocab_size"] * shape["hidden_size"]


def model_flops(shape: dict, n_matmul: int, lengths: list[int]) -> float:
    """Training FLOPs (forward + backward) of samples of these lengths (see the docstring)."""
    attn = 12 * shape["num_hidden_layers"] * shape["hidden_size"]
    return sum(6 * n_matmul * n + attn * n * n for n in lengths)


def peak_flops(plan: Plan) -> tuple[float | None, str]:
    """(FLOP/s the MFU is measured against or None, what that figure is)."""
    import torch

    if plan.device == "cuda":
        name = torch.cuda.get_device_name()
        for key, tflops in BF16_PEAK_TFLOPS:
            if key in name:
                return tflops * 1e12, f"{name}: dense bf16 peak {tflops:.0f} TFLOP/s"
        return None, f"{name}: bf16 peak unknown (not in BF16_PEAK_TFLOPS), MFU not computed"
    a = torch.randn(512, 512, dtype=getattr(torch, plan.param_dtype))
    for _ in range(5):
        a @ a
    t0, n = time.perf_counter(), 40
    for _ in range(n):
        a @ a
    rate = n * 2 * 512**3 / (time.perf_counter() - t0)
    return rate, (f"CPU: measured {plan.param_dtype} 512x512 matmul rate {rate / 1e9:.1f} "
                  "GFLOP/s stands in for the peak (not a GPU figure)")  # fmt: skip


def peak_memory_gib(plan: Plan) -> float:
    """CUDA: torch's peak allocated memory since the last reset; CPU: this process's peak RSS."""
    import torch

    if plan.device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return harness.peak_rss_mb_self() / 1024


def reset_peak_memory(plan: Plan) -> None:
    import torch

    if plan.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def sft_samples(plan: Plan, rng: random.Random, vocab: int) -> list:
    from training.data.tokenize import TokenizedSample

    n = plan.sft_sample_len
    return [TokenizedSample(tuple(rng.randrange(5, vocab) for _ in range(n)), (0,) * 8 + (1,) * (n - 8),
                            "gpu_check") for _ in range(plan.sft_samples)]  # fmt: skip


def even_share(response_ids: tuple[int, ...]) -> float:
    """The reward of the check: the share of even token ids (varied under random weights)."""
    return sum(1 for t in response_ids if t % 2 == 0) / max(1, len(response_ids))


async def sample_groups(engine, plan: Plan, rng: random.Random, vocab: int, step: int):
    """A RolloutBatch of `rl_prompts` groups of `rl_group` samples from the engine."""
    from rollouts.types import RolloutBatch, Sample

    prompts = [[rng.randrange(5, vocab) for _ in range(plan.prompt_len)]
               for _ in range(plan.rl_prompts)]  # fmt: skip
    params = {"n": plan.rl_group, "max_new_tokens": plan.response_len, "temperature": 1.0,
              "ignore_eos": True}  # fmt: skip
    results = await engine.generate_batch(prompts, params)
    groups = []
    for g, prompt in enumerate(prompts):
        group = []
        for i, r in enumerate(results[g * plan.rl_group : (g + 1) * plan.rl_group]):
            sample = Sample(tuple(prompt), r.output_ids, (1,) * len(r.output_ids),
                            rollout_logprobs=r.output_logprobs or (), group_id=g,
                            index_in_group=i, weight_version=step)  # fmt: skip
            group.append(sample.with_reward(even_share(r.output_ids)))
        groups.append(tuple(group))
    return RolloutBatch(tuple(groups), step, 0)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


async def measure(plan: Plan, tmp: Path, profile: Path | None = None,
                  budget: Budget | None = None, checkpoint=None) -> dict:  # fmt: skip
    """Rank 0's run (world size 1), the most valuable rows first: SFT, then GRPO with the
    engine and weight syncs (its batches are the variants'), then, while `budget` allows, the
    +large micro-batch row, the peer (benchmarks/gpu_peer.py), the other variants, fused AdamW
    and +compile last. With `profile`, one more SFT step and GRPO update under torch.profiler,
    after the measured ones (the figures do not include them), written to `profile`.
    `checkpoint(figures)`, if given, is called before +compile with every row so far (the
    others say they were still to run): a compile that outlasts the device call's `timeout`
    then loses its own row only."""
    from training.backend.pytorch import load_model, load_tokenizer

    budget = budget or Budget(math.inf, 0.0)
    model_dir = build_model_dir(tmp / "model", plan.shape)
    tok = load_tokenizer(model_dir)
    vocab, rng = len(tok), random.Random(0)
    build = partial(load_model, str(model_dir), device=plan.device)
    n_matmul = matmul_params(plan.shape)
    figures: dict = {"n_params": n_matmul}

    t0 = time.monotonic()
    sft, figures["sft"] = await sft_phase(plan, tmp, build, tok, n_matmul, fused=False)
    budget.record("sft", time.monotonic() - t0)
    progress("SFT step", figures["sft"], time.monotonic() - t0, budget)
    profiles = []
    if profile is not None:
        batch = sft_samples(plan, rng, vocab)
        with profiled(plan) as prof:
            await sft_step(sft, batch, plan)
        profiles.append(("SFT step", prof))
    sft.close()
    del sft
    rl_batches = await grpo_phase(plan, tmp, model_dir, build, tok, n_matmul, rng, figures,
                                  profiles if profile is not None else None, budget)  # fmt: skip
    if profile is not None:
        write_profiles(plan, profiles, profile)

    sft_rng = random.Random(1)  # sft_phase's batches
    sft_batches = [sft_samples(plan, sft_rng, vocab) for _ in range(plan.sft_steps)]
    rows: dict = {}

    async def variant(v) -> None:
        kind = "compile" if v.compile_layers else "variant"
        rows[v.name] = await optional_row(budget, v.name, kind, partial(
            variant_row, plan, v, tmp, model_dir, tok, n_matmul, sft_batches, rl_batches))  # fmt: skip

    async def peer() -> dict:
        try:
            return peer_row(plan, model_dir, sft_batches, n_matmul, sys.modules[__name__],
                            busy_share, budget.left)  # fmt: skip
        except Exception as exc:  # its row's text; the script exits 1
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}

    by_name = {v.name: v for v in GPU_VARIANTS}
    await variant(by_name["+large micro-batch"])
    figures["peer"] = await optional_row(budget, "peer (plain torch SFT)", "peer", peer)
    if "config" in figures["peer"]:  # how it ran, and the ratio so far (a later kill keeps it)
        value, row = ratio({**figures, "variants": rows})
        progress(
            "peer ran", f"{figures['peer']['config']}; ours / peer so far {value:.2f}x ({row})"
        )
    await variant(AUTO)  # the default micro-batch size: its estimate meets the GPU here
    for v in GPU_VARIANTS:
        if v.name not in ("+large micro-batch", AUTO.name) and not v.compile_layers:
            await variant(v)
    figures["sft_fused"] = await optional_row(budget, "SFT step, fused AdamW", "sft_fused",
                                              partial(fused_row, plan, tmp, build, tok, n_matmul))  # fmt: skip
    if checkpoint is not None:
        pending = {"error": "skipped: still to run when this table was written"}
        checkpoint(
            {**figures, "variants": {v.name: rows.get(v.name, pending) for v in GPU_VARIANTS}}
        )
    for v in GPU_VARIANTS:
        if v.compile_layers:
            await variant(v)
    figures["variants"] = {v.name: rows[v.name] for v in GPU_VARIANTS}  # the table's order
    return figures


async def fused_row(plan: Plan, tmp: Path, build, tok, n_matmul: int) -> dict:
    """The SFT phase again with fused AdamW; an optional kernel, so its failure on some GPU or
    torch is its row's text (the script then exits 1), not a lost run."""
    try:
        fused, figures = await sft_phase(plan, tmp, build, tok, n_matmul, fused=True)
        fused.close()
        return figures
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


async def grpo_phase(plan: Plan, tmp: Path, model_dir: Path, build, tok, n_matmul: int,
                     rng: random.Random, figures: dict, profiles: list | None,
                     budget: Budget) -> list:  # fmt: skip
    """GRPO steps on groups the local engine sampled, each followed by a weight sync; writes
    figures "grpo", "engine", "weight_sync_s", the versions; returns the sampled batches (each
    change's row trains them again, benchmarks/gpu_variants.py)."""
    from engines import SGLangEngine, launch_engine
    from training.backend.pytorch import PyTorchTrainingBackend
    from training.config import OptimConfig
    from training.loops.weight_push import push_weights
    from training.rl.algorithms import grpo
    from training.rl.batch import collate_rl
    from training.rl.step import train_on_batch

    vocab = len(tok)
    free_device_memory(plan)
    reset_peak_memory(plan)
    t_build = time.monotonic()
    rl = PyTorchTrainingBackend(build, tok, optim=OptimConfig(lr=1e-5, schedule="constant"),
                                max_steps=100, checkpoint_dir=tmp / "rl", pack_length=None,
                                micro_batch_tokens=plan.micro_batch_tokens,
                                collate_fn=partial(collate_rl, pad_id=tok.pad_token_id))  # fmt: skip
    t_build = time.monotonic() - t_build
    engine_args = ["--device", plan.device, "--dtype", plan.engine_dtype, "--weight-version", "0",
                   "--max-running-requests", str(plan.rl_prompts * plan.rl_group)]  # fmt: skip
    times, flops, tokens, gen_s, gen_tokens, sync_s = [], [], [], [], [], []
    rl_batches = []
    t_phase = time.monotonic()
    async with (
        launch_engine(kind="local", model_path=model_dir, extra_args=engine_args,
                      log_path=tmp / "engine.log", startup_timeout_s=600) as launched,
        SGLangEngine(launched.url) as engine,
    ):  # fmt: skip
        for step in range(plan.rl_steps):
            t0 = time.perf_counter()
            batch = await sample_groups(engine, plan, rng, vocab, step)
            rl_batches.append(batch)
            gen_s.append(time.perf_counter() - t0)
            lengths = [len(s.prompt_ids) + len(s.response_ids) for g in batch.groups for s in g]
            gen_tokens.append(sum(len(s.response_ids) for g in batch.groups for s in g))
            t0 = time.perf_counter()
            metrics = await train_on_batch(rl, batch, grpo(), temperature=1.0,
                                           old_from_rollout=False, reference=None)  # fmt: skip
            sync(plan.device)
            times.append(time.perf_counter() - t0)
            tokens.append(sum(lengths))
            flops.append(model_flops(plan.shape, n_matmul, lengths))
            t0 = time.perf_counter()
            await push_weights(rl, [engine], tmp / "weights")
            sync_s.append(time.perf_counter() - t0)
        # read now: the peak is this phase's, not a later row's
        figures["grpo"] = phase_figures(plan, times, tokens, flops, loss=metrics["loss"])
        if profiles is not None:
            batch = await sample_groups(engine, plan, rng, vocab, plan.rl_steps)
            with profiled(plan) as prof:
                await train_on_batch(rl, batch, grpo(), temperature=1.0, old_from_rollout=False,
                                     reference=None)  # fmt: skip
                sync(plan.device)
            profiles.append(("GRPO update", prof))
            await push_weights(rl, [engine], tmp / "weights")
        figures["served_version"] = (await engine.model_info()).weight_version
    figures["trained_version"] = str(rl.weight_version)
    rl.close()
    del rl
    w = plan.warmup
    figures["engine"] = {"generate_s": harness.median(gen_s[w:]),
                         "tokens_per_s": sum(gen_tokens[w:]) / sum(gen_s[w:])}  # fmt: skip
    figures["weight_sync_s"] = harness.median(sync_s[w:])
    budget.record("grpo_train", t_build + sum(times) * (1 + 1 / plan.rl_steps))
    progress("GRPO update (with the engine)", figures["grpo"], time.monotonic() - t_phase, budget)
    return rl_batches


async def sft_phase(plan: Plan, tmp: Path, build, tok, n_matmul: int, *, fused: bool):
    """(the backend, its figures) after `plan.sft_steps` SFT steps on the same batches each
    time (seed 1), AdamW fused or not."""
    from training.backend.pytorch import PyTorchTrainingBackend
    from training.config import OptimConfig

    optim = OptimConfig(lr=1e-5, schedule="constant", fused=fused)
    rng = random.Random(1)
    free_device_memory(plan)
    reset_peak_memory(plan)
    sft = PyTorchTrainingBackend(build, tok, optim=optim, max_steps=100,
                                 checkpoint_dir=tmp / ("sft_fused" if fused else "sft"),
                                 pack_length=plan.pack_length,
                                 micro_batch_tokens=plan.micro_batch_tokens)  # fmt: skip
    times, flops, tokens = [], [], []
    for _ in range(plan.sft_steps):
        batch = sft_samples(plan, rng, len(tok))
        t0 = time.perf_counter()
        metrics = await sft_step(sft, batch, plan)
        times.append(time.perf_counter() - t0)
        tokens.append(metrics["n_tokens"])
        flops.append(model_flops(plan.shape, n_matmul, [len(s) for s in batch]))
    return sft, phase_figures(plan, times, tokens, flops, loss=metrics["loss"])


async def sft_step(sft, batch: list, plan: Plan) -> dict:
    """One SFT step (forward_backward + optim_step), finished on the device; its metrics."""
    fb = sft.forward_backward(batch)
    await sft.optim_step().result()
    metrics = await fb.result()
    sync(plan.device)
    return metrics


def free_device_memory(plan: Plan) -> None:
    """Give an earlier phase's freed memory back (its peak is not the next phase's)."""
    import gc

    import torch

    gc.collect()
    if plan.device == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def profiled(plan: Plan) -> Iterator:
    """torch.profiler over the block: CPU and, on CUDA, the GPU's kernels; every thread's ops
    (the backend runs them on its own thread)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if plan.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities,
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:  # fmt: skip
        yield prof


def write_profiles(plan: Plan, profiles: list, path: Path, rows: int = 25) -> None:
    """Each profiled phase's top ops by self time on the device (CPU time on CPU)."""
    key = "self_device_time_total" if plan.device == "cuda" else "self_cpu_time_total"
    parts = []
    for label, prof in profiles:
        table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
        parts.append(f"## {label}: top {rows} ops by {key}\n\n{table}")
    path.write_text("\n\n".join(parts), encoding="utf-8")
    print(f"wrote the profiles ({', '.join(label for label, _ in profiles)}) to {path}")


def phase_figures(plan: Plan, times: list[float], tokens: list[int], flops: list[float], *,
                  loss: float) -> dict:  # fmt: skip
    w = plan.warmup
    return {"step_s": harness.median(times[w:]), "tokens_per_s": sum(tokens[w:]) / sum(times[w:]),
            "tflops": sum(flops[w:]) / sum(times[w:]) / 1e12,
            "peak_memory_gib": peak_memory_gib(plan), "loss": loss}  # fmt: skip


def run(plan: Plan, profile: Path | None = None, budget: Budget | None = None,
        checkpoint=None) -> dict:  # fmt: skip
    """Join a process group of one (NCCL on CUDA, gloo on CPU) and run `measure` on rank 0."""
    import trio

    from engines.launch import find_free_port
    from training.config import BackendConfig, FSDPConfig
    from training.distributed import current, run_rank0

    for key, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(find_free_port()))):  # fmt: skip
        os.environ.setdefault(key, value)
    fsdp = FSDPConfig(at_world_size_1=True, param_dtype=plan.param_dtype, reduce_dtype="float32")
    config = BackendConfig(device=plan.device, fsdp=fsdp)

    def main() -> dict:
        ctx = current()
        assert ctx is not None and ctx.world == 1, "expected a process group of one"
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            figures = trio.run(measure, plan, Path(tmp), profile, budget, checkpoint)
        import torch.distributed as dist

        figures["process_group"] = dist.get_backend()
        return figures

    result = run_rank0(config, main)
    assert result is not None
    return result


def report(plan: Plan, figures: dict, peak: float | None, peak_text: str
           ) -> tuple[list[str], list[str]]:  # fmt: skip
    """(markdown parts, notes) of the figures; MFU against `peak` FLOP/s (None: unknown)."""
    import torch

    rows = []
    for phase, label in PHASES:
        f = figures[phase]
        if "error" in f:
            text = f["error"] if f["error"].startswith("skipped") else "failed: " + f["error"]
            rows.append([label, text, "", "", "", "", ""])
            continue
        f["mfu"] = f["tflops"] * 1e12 / peak if peak else None
        mfu = f"{100 * f['mfu']:.1f} %" if peak else "n/a"
        rows.append([label, f["step_s"], f["tokens_per_s"], f["tflops"], mfu,
                     f["peak_memory_gib"], f["loss"]])  # fmt: skip
    memory = "peak allocated (GiB)" if plan.device == "cuda" else "peak RSS (GiB)"
    table = harness.md_table(["phase", "step (s)", "tokens/s", "model TFLOP/s", "MFU", memory,
                              "loss"], rows)  # fmt: skip
    device = torch.cuda.get_device_name() if plan.device == "cuda" else harness.cpu_model()
    shape = plan.shape
    notes = [
        f"- Device: {device}; {peak_text}.",
        f"- Model: Qwen2, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} KV heads, MLP "
        f"{shape['intermediate_size']}, vocabulary {shape['vocab_size']:,}, tied embeddings; "
        f"{figures['n_params']:,} weights that multiply; random weights.",
        f"- Training: FSDP2 in a process group of one ({figures['process_group']}), compute in "
        f"{plan.param_dtype} over fp32 master weights, AdamW; SFT {plan.sft_samples} samples x "
        f"{plan.sft_sample_len} tokens per step packed into rows of {plan.pack_length}; GRPO "
        f"{plan.rl_prompts} prompts x {plan.rl_group} samples, {plan.prompt_len}-token prompts, "
        f"{plan.response_len}-token responses; micro-batches of {plan.micro_batch_tokens} "
        f"tokens; medians over the steps after the first {plan.warmup}; the fused row runs the "
        "same SFT steps (same batches) with `optim.fused` (one fused AdamW kernel).",
        f"- Local engine ({plan.device}, {plan.engine_dtype}): "
        f"{figures['engine']['tokens_per_s']:,.0f} generated tokens/s "
        f"({figures['engine']['generate_s']:.2f} s per batch of "
        f"{plan.rl_prompts * plan.rl_group} responses).",
        "- Peak memory is the trainer process's, per phase (the engine is its own process)."
        if plan.device == "cuda"
        else "- Peak RSS is the trainer process's, since it started.",
        f"- Weight sync (push_weights: export + the engine's load, as the RL loop does): "
        f"{figures['weight_sync_s']:.2f} s; the engine serves version "
        f"{figures['served_version']} after {figures['trained_version']} GRPO steps.",
    ]
    notes.append(
        "- Changes of issue 43, each row adding one (cumulative; benchmarks/gpu_variants.py): "
        "fresh backends from the same weights on the same SFT batches and sampled GRPO batches; "
        "MFU (hardware) counts a shared prompt once per row; GPU busy is the kernel time of "
        "one profiled step over its wall time. Losses and grad norms must agree across rows."
    )
    variants = figures.get("variants")
    parts = [table] + ([variant_table(variants, peak)] if variants else [])
    if "peer" in figures:
        parts += [peer_table(figures["peer"], peak), ratio_line(figures)]
        notes.append(
            "- Peer (benchmarks/gpu_peer.py): a plain PyTorch SFT loop as a strong peer writes it, "
            "no project code in its step: the same model directory (HF, sdpa), fp32 masters "
            "with bf16 autocast, fused AdamW on CUDA, per-layer `torch.compile` on CUDA (eager "
            "on CPU), a chunked linear cross-entropy (gradients in the forward pass, no "
            "[tokens x vocabulary] tensor), the same samples packed into the same rows with "
            "position ids restarting per sample, trained on the same batches as the SFT rows. "
            "transformers builds sdpa a block-diagonal mask from those position ids, so its "
            "samples do not see each other (masked sdpa kernel, not flash): its loss is the "
            "project's up to bf16 rounding. TRL's SFTTrainer was not carried: its wheels "
            "(datasets, pyarrow, pandas) are ~57 MB beside the ~60 MB the device tool carries."
        )
    return parts, notes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="the same code on CPU at tiny size (what make test runs)")  # fmt: skip
    p.add_argument("--results", type=Path, default=None,
                   help="the RESULTS.md to write (default: benchmarks/RESULTS.md; with "
                   "--dry-run benchmarks/results/quick/RESULTS.md)")  # fmt: skip
    p.add_argument("--profile", type=Path, default=None,
                   help="also profile one more SFT step and GRPO update (torch.profiler, after "
                   "the measured steps) and write their top ops by device time to this file")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds the whole script may take (default 540 on a GPU: one 10-minute "
                   "device call; 3600 with --dry-run); an optional row (fused AdamW, a change of "
                   "issue 43, the peer) that the rows measured so far say would not fit is "
                   "skipped, and says so in its cell")  # fmt: skip
    args = p.parse_args()
    started_mono = time.monotonic()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine, or with --dry-run for "
              "the CPU smoke run", file=sys.stderr)  # fmt: skip
        return 2
    plan = DRY if args.dry_run else GPU
    started = time.time()
    peak, peak_text = peak_flops(plan)
    budget_s = args.budget_s if args.budget_s is not None else (3600 if args.dry_run else 540)
    # the report, the engine's and the process group's teardown after the last row
    budget = Budget(
        started_mono + budget_s - RESERVE_S, COMPILE_S if plan.device == "cuda" else 0.0
    )
    smoke = "Dry run (`--dry-run`: CPU, tiny model): checks the code path; not GPU figures." if args.dry_run else ""  # fmt: skip
    title = "GPU check: SFT, GRPO, FSDP2, local engine and weight sync on one GPU"

    def write(figures: dict, final: bool = True) -> None:
        """The section from `figures` (before +compile too: a kill then keeps the rest)."""
        import torch.distributed as dist

        figures.setdefault("process_group", dist.get_backend() if dist.is_initialized() else "")
        figures["peer_ratio"], figures["peer_ratio_ours"] = ratio(figures)
        parts, notes = report(plan, figures, peak, peak_text)
        if final:
            print(f"\n{title}\n" + "\n".join(parts) + "\n" + "\n".join(notes))
        harness.write_section("gpu_check", title, "\n\n".join(parts) + "\n\n" + "\n".join(notes),
                              quick=args.dry_run, started=started, path=args.results,
                              smoke=smoke)  # fmt: skip
        print(f"gpu_check: wrote the section{'' if final else ' so far (before +compile)'}",
              flush=True)  # fmt: skip

    figures = run(plan, args.profile, budget, partial(write, final=False))
    write(figures)
    harness.emit({k: v for k, v in figures.items() if k != "process_group"})
    # a change's failure on the GPU is its row's text and a failed check (CPU skips compile)
    optional = {**figures["variants"], "peer": figures["peer"]}
    bad_variants = [k for k, v in optional.items() if failed(v)]
    bad = [k for k, _ in PHASES if failed(figures[k]) or ("error" not in figures[k] and not all(
           math.isfinite(v) and v > 0 for v in
           (figures[k]["step_s"], figures[k]["tokens_per_s"], figures[k]["tflops"])))]  # fmt: skip
    return 1 if bad or bad_variants else 0


if __name__ == "__main__":
    sys.exit(main())
