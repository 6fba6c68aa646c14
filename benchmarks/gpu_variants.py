"""The GPU check's rows per change of issue 43 (benchmarks/gpu_check.py calls `variant_row`
per change, in its own order and time budget).

Each variant of benchmarks/launch_counts.py (today, +accumulate, +segments, +large
micro-batch, +compile; cumulative, each through its config switch) trains fresh backends from
the same weights on the same SFT batches and the same sampled GRPO batches, and reports per
phase: step s, tokens/s, MFU by the project's formula (every sample's tokens, as gpu_check)
and by hardware FLOPs (the tokens the model ran: a shared prompt once per row), peak memory,
the GPU-busy share of one profiled step (kernel time / wall time; None on CPU), loss and grad
norm. Losses and grad norms must agree across the rows to bf16 noise: that is the GPU's check
of the varlen kernel's causal alignment and of the accumulation.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import harness
from launch_counts import VARIANTS, Variant


def busy_share(prof, wall_s: float) -> float | None:
    """Kernel time over the wall time of the profiled block (None without CUDA events)."""
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages()
                    if e.device_type.name == "CUDA")  # fmt: skip
    return kernel_us / 1e6 / wall_s if kernel_us > 0 else None


async def variant_row(plan, v: Variant, tmp: Path, model_dir: Path, tok, n_matmul: int,
                      sft_batches: list, rl_batches: list) -> dict:  # fmt: skip
    """{"sft": figures, "grpo": figures} of the change `v`, or {"error": text} (a kernel's or a
    compile's failure is its row's text, not a lost run)."""
    import gpu_check as gc_

    from training.distributed import current

    if v.compile_layers and plan.device == "cpu":
        return {"error": "skipped on CPU (Inductor compiles for minutes)"}
    ctx = current()
    assert ctx is not None
    saved = ctx.fsdp
    ctx.fsdp = saved.model_copy(update={"accumulate_unsharded": v.accumulate,
                                        "compile_layers": v.compile_layers})  # fmt: skip
    try:
        return {
            "sft": await _sft(gc_, plan, v, tmp, model_dir, tok, n_matmul, sft_batches),
            "grpo": await _grpo(gc_, plan, v, tmp, model_dir, tok, n_matmul, rl_batches),
        }
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        ctx.fsdp = saved


# launch_counts' changes, plus `backend.micro_batch_tokens: auto` (the default): the largest
# micro-batch the GPU's free memory holds by the backend's estimate, chosen after the model is
# built (on CPU: 8192). Its row checks that estimate: its peak GiB must stay under the free
# memory its log line names. Not a launch-count row: on CPU it is a fixed size.
AUTO = Variant("+auto micro-batch", "segments", accumulate=True, auto_micro_batches=True)
GPU_VARIANTS = (*VARIANTS[:-1], AUTO, VARIANTS[-1])


def _micro_batch_tokens(plan, v: Variant) -> int | str:
    if v.auto_micro_batches:
        return "auto"
    return 4 * plan.micro_batch_tokens if v.large_micro_batches else plan.micro_batch_tokens


async def _sft(gc_, plan, v: Variant, tmp: Path, model_dir: Path, tok, n_matmul: int,
               batches: list) -> dict:  # fmt: skip
    from training.backend.pytorch import PyTorchTrainingBackend, load_model
    from training.config import OptimConfig

    gc_.free_device_memory(plan)
    gc_.reset_peak_memory(plan)
    build = partial(load_model, str(model_dir), device=plan.device, attention=v.attention)
    sft = PyTorchTrainingBackend(build, tok, optim=OptimConfig(lr=1e-5, schedule="constant"),
                                 max_steps=100, checkpoint_dir=tmp / f"v-sft-{v.name}",
                                 pack_length=plan.pack_length,
                                 micro_batch_tokens=_micro_batch_tokens(plan, v))  # fmt: skip
    times, flops, tokens = [], [], []
    for batch in batches:
        t0 = time.perf_counter()
        fb = sft.forward_backward(batch)
        step = await sft.optim_step().result()
        metrics = await fb.result()
        gc_.sync(plan.device)
        times.append(time.perf_counter() - t0)
        tokens.append(metrics["n_tokens"])
        flops.append(gc_.model_flops(plan.shape, n_matmul, [len(s) for s in batch]))
    figures = gc_.phase_figures(plan, times, tokens, flops, loss=metrics["loss"])
    figures["hw_tflops"] = figures["tflops"]  # packed rows: every sample token is computed once
    figures["grad_norm"] = step["grad_norm"]
    figures["micro_batch_tokens"] = sft.micro_batch_tokens
    t0 = time.perf_counter()
    with gc_.profiled(plan) as prof:
        await gc_.sft_step(sft, batches[-1], plan)
    figures["gpu_busy"] = busy_share(prof, time.perf_counter() - t0)
    sft.close()
    return figures


async def _grpo(gc_, plan, v: Variant, tmp: Path, model_dir: Path, tok, n_matmul: int,
                batches: list) -> dict:  # fmt: skip
    from training.backend.pytorch import PyTorchTrainingBackend, load_model
    from training.config import OptimConfig
    from training.rl.algorithms import grpo
    from training.rl.batch import collate_rl
    from training.rl.step import train_on_batch

    gc_.free_device_memory(plan)
    gc_.reset_peak_memory(plan)
    build = partial(load_model, str(model_dir), device=plan.device, attention=v.attention)
    rl = PyTorchTrainingBackend(build, tok, optim=OptimConfig(lr=1e-5, schedule="constant"),
                                max_steps=100, checkpoint_dir=tmp / f"v-rl-{v.name}",
                                pack_length=None, micro_batch_tokens=_micro_batch_tokens(plan, v),
                                collate_fn=partial(collate_rl, pad_id=tok.pad_token_id))  # fmt: skip
    times, flops, hw, tokens = [], [], [], []
    for batch in batches:
        t0 = time.perf_counter()
        metrics = await train_on_batch(rl, batch, grpo(), temperature=1.0, old_from_rollout=False,
                                       reference=None)  # fmt: skip
        gc_.sync(plan.device)
        times.append(time.perf_counter() - t0)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for g in batch.groups for s in g]
        tokens.append(sum(lengths))
        flops.append(gc_.model_flops(plan.shape, n_matmul, lengths))
        # hardware: each group's prompt runs once (prefix sharing), its attention term as counted
        shared = sum(len(g[0].prompt_ids) * (len(g) - 1) for g in batch.groups)
        hw.append(flops[-1] - 6 * n_matmul * shared)
    figures = gc_.phase_figures(plan, times, tokens, flops, loss=metrics["loss"])
    w = plan.warmup
    figures["hw_tflops"] = sum(hw[w:]) / sum(times[w:]) / 1e12
    figures["grad_norm"] = metrics["grad_norm"]
    figures["micro_batch_tokens"] = rl.micro_batch_tokens
    t0 = time.perf_counter()
    with gc_.profiled(plan) as prof:
        await train_on_batch(rl, batches[-1], grpo(), temperature=1.0, old_from_rollout=False,
                             reference=None)  # fmt: skip
        gc_.sync(plan.device)
    figures["gpu_busy"] = busy_share(prof, time.perf_counter() - t0)
    rl.close()
    return figures


def variant_table(rows: dict, peak: float | None) -> str:
    """The markdown table of `variant_row`'s figures per change, MFU against `peak` FLOP/s."""

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f} %"

    out = []
    for name, r in rows.items():
        if "error" in r:
            text = r["error"] if r["error"].startswith("skipped") else "failed: " + r["error"]
            out.append([name, "", text, "", "", "", "", "", "", "", ""])
            continue
        for phase in ("sft", "grpo"):
            f = r[phase]
            mfu = f["tflops"] * 1e12 / peak if peak else None
            hw = f["hw_tflops"] * 1e12 / peak if peak else None
            out.append([name, phase.upper(), f"{f['micro_batch_tokens']:,}", f["step_s"],
                        f["tokens_per_s"], pct(mfu), pct(hw), f["peak_memory_gib"],
                        pct(f["gpu_busy"]), f["loss"], f["grad_norm"]])  # fmt: skip
    return harness.md_table(["change (cumulative)", "phase", "micro-batch", "step (s)", "tokens/s",
                             "MFU (project)", "MFU (hardware)", "peak GiB", "GPU busy", "loss",
                             "grad norm"], out)  # fmt: skip
