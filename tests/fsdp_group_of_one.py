"""One forward_backward per mode in an FSDP2 process group of one (gloo), bf16 compute over fp32
master weights, as benchmarks/gpu_check.py runs, with `fsdp.accumulate_unsharded` off (today's
per-micro-batch gather, cast and reduce) and on, the tiny model untied and tied; rank 0 writes each run's whole gradient, its
loss and the copy ops it launched (torch.profiler). tests/test_fsdp_accumulation.py compares.

    python tests/fsdp_group_of_one.py MODEL_DIR OUT_DIR   # OUT_DIR/<mode>-<on|off>.safetensors
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

from plumbing.gc_pause import gc_paused

with gc_paused(freeze=True):  # torch, transformers, the project: plumbing/gc_pause.py
    import torch
    import trio
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # rl_helpers, distributed_grads
    from distributed_grads import sft_samples
    from rl_helpers import batch_of
    from tied_model import tied_copy

    from engines import find_free_port
    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.config import BackendConfig, FSDPConfig, LoraSettings, OptimConfig
    from training.distributed import current, run_rank0
    from training.rl.algorithms import grpo
    from training.rl.batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn

MODES = ("sft", "grpo", "sft-lora", "sft-tied")
COPIES = ("aten::copy_", "aten::_to_copy")


async def one(model_dir: str, out: Path, mode: str, accumulate: bool) -> dict:
    ctx = current()
    assert ctx is not None and ctx.world == 1
    ctx.fsdp = ctx.fsdp.model_copy(update={"accumulate_unsharded": accumulate})
    tokenizer = load_tokenizer(model_dir)
    lora = LoraSettings(rank=4) if mode.endswith("-lora") else None
    common = dict(optim=OptimConfig(lr=1e-3, schedule="constant"), max_steps=2, lora=lora,
                  checkpoint_dir=out / f"ckpt-{mode}-{accumulate}")  # fmt: skip
    if mode.endswith("-tied"):  # one parameter at both ends, in the root FSDP unit
        model_dir = str(tied_copy(model_dir, out / "tied"))
    torch.manual_seed(0)
    if mode.startswith("sft"):
        backend = PyTorchTrainingBackend(partial(load_model, model_dir), tokenizer,
                                         pack_length=64, micro_batch_tokens=128, **common)  # fmt: skip
        args: dict = {}
        rows = sft_samples(tokenizer)
    else:
        backend = PyTorchTrainingBackend(
            partial(load_model, model_dir), tokenizer, pack_length=None, micro_batch_tokens=40,
            collate_fn=partial(collate_rl, pad_id=tokenizer.pad_token_id), **common,
        )  # fmt: skip
        algorithm = grpo()
        rewards = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2], [0.3, 0.9, 0.0, 1.0]]
        rows = build_examples(batch_of(rewards, n_response=lambda g, i: 3 + (g * 5 + i * 3) % 7),
                              algorithm)  # fmt: skip
        args = dict(loss_fn=rl_loss_fn(algorithm), loss_weight_fn=loss_weight_fn(algorithm))
    if lora is not None:  # a first step makes B ≠ 0, so that A's gradient is not 0 either
        await backend.forward_backward(rows, **args).result()
        await backend.optim_step().result()
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU],  # the backend's thread runs the ops
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:  # fmt: skip
        metrics = await backend.forward_backward(rows, **args).result()
    copies = sum(e.count for e in prof.key_averages() if e.key in COPIES)
    grads = await backend.full_grads().result()
    name = f"{mode}-{'on' if accumulate else 'off'}"
    save_file({k: v.contiguous() for k, v in grads.items()}, str(out / f"{name}.safetensors"))
    backend.close()
    return {"name": name, "loss": metrics["loss"], "n_microbatches": metrics["n_microbatches"],
            "copies": copies}  # fmt: skip


async def all_runs(model_dir: str, out: Path) -> None:
    results = [await one(model_dir, out, m, a) for m in MODES for a in (False, True)]
    (out / "results.json").write_text(json.dumps(results))


def main() -> int:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for key, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(find_free_port()))):  # fmt: skip
        os.environ.setdefault(key, value)
    fsdp = FSDPConfig(at_world_size_1=True, param_dtype="bfloat16", reduce_dtype="float32")
    config = BackendConfig(num_threads=1, fsdp=fsdp)
    run_rank0(config, lambda: trio.run(all_runs, model_dir, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
