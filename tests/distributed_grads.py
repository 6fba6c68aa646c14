"""One forward_backward on a fixed batch, at whatever world size this is launched with; rank 0
writes the whole gradients and the loss metrics. `tests/test_distributed.py` runs it under
plain python and under `torchrun --nproc_per_node 2` and compares the two.

Each mode builds its backend, uses it, closes and drops it, as a sweep or a notebook would; every
rank appends to OUT_DIR/models-rank{R}.txt when it builds a model and when that model is
collected, so the test can check that each rank freed one mode's model before the next was built.

    python tests/distributed_grads.py MODEL_DIR OUT_DIR MODE[,MODE...]   # OUT_DIR/MODE/...
    modes: sft, grpo-token-mean, grpo-seq-mean, each with `-lora` (LoRA adapters, rank 4) or
    `-tied` (the output layer tied to the input embeddings)
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import weakref
from functools import partial
from pathlib import Path

from plumbing.gc_pause import gc_paused

with gc_paused(freeze=True):  # torch, transformers, the project: plumbing/gc_pause.py
    import trio
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # rl_helpers
    from rl_helpers import batch_of

    from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
    from training.config import BackendConfig, LoraSettings, OptimConfig
    from training.data.tokenize import tokenize_conversation
    from training.distributed import run_rank0
    from training.rl.algorithms import grpo
    from training.rl.batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn


_BUILT = itertools.count()


def watched_model(model_dir: str, log_dir: str):
    """load_model, recording in log_dir/models-rank{R}.txt its build and its collection."""
    model = load_model(model_dir)
    n, log = next(_BUILT), Path(log_dir, f"models-rank{os.environ.get('RANK', '0')}.txt")
    _note(log, f"built {n}")
    weakref.finalize(model, _note, log, f"freed {n}")
    return model


def tied_model(model_dir: str, log_dir: str):
    """`watched_model` with its output layer tied to the input embeddings (one Parameter)."""
    return tie_embeddings(watched_model(model_dir, log_dir))


def tie_embeddings(model):
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _note(log: Path, line: str) -> None:
    with log.open("a") as f:
        f.write(line + "\n")


def sft_samples(tokenizer) -> list:
    out = []
    for i in range(13):  # odd count, varied lengths: ranks get unequal shares and micro-batches
        a, b = 3 * i + 1, 7 * i * i + 2
        messages = [{"role": "user", "content": f"{a} + {b} = ?" + " please" * (i % 4)},
                    {"role": "assistant", "content": f"{a + b}" + " done" * (i % 3)}]  # fmt: skip
        out.append(tokenize_conversation(tokenizer, messages, source=f"s{i}"))
    return out


async def one_step(model_dir: str, out: Path, mode: str) -> dict:
    import distributed_grads as me  # by import path, so that the other ranks build it too

    mode, tied, _ = mode.partition("-tied")
    build = partial(me.tied_model if tied else me.watched_model, model_dir, str(out.parent))
    tokenizer = load_tokenizer(model_dir)
    optim = OptimConfig(lr=1e-3, schedule="constant")
    mode, with_lora, _ = mode.partition("-lora")
    lora = LoraSettings(rank=4) if with_lora else None
    if mode == "sft":
        backend = PyTorchTrainingBackend(
            build, tokenizer, optim=optim, max_steps=2,
            checkpoint_dir=out / "ckpt", pack_length=64, micro_batch_tokens=128, lora=lora,
        )  # fmt: skip
        if lora is not None:  # a first step makes B ≠ 0, so that A's gradient is not 0 either
            await backend.forward_backward(sft_samples(tokenizer)).result()
            await backend.optim_step().result()
        metrics = await backend.forward_backward(sft_samples(tokenizer)).result()
    else:
        aggregation = "token-mean" if mode == "grpo-token-mean" else "seq-mean-token-mean"
        algorithm = grpo(aggregation=aggregation)
        backend = PyTorchTrainingBackend(
            build, tokenizer, optim=optim, max_steps=2,
            checkpoint_dir=out / "ckpt", pack_length=None, micro_batch_tokens=96,
            collate_fn=partial(collate_rl, pad_id=tokenizer.pad_token_id), lora=lora,
        )  # fmt: skip
        rewards = [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2], [0.3, 0.9, 0.0, 1.0]]
        batch = batch_of(rewards, n_response=lambda g, i: 3 + (g * 5 + i * 3) % 7)
        examples = build_examples(batch, algorithm)
        if lora is not None:  # as above
            await backend.forward_backward(
                examples, loss_fn=rl_loss_fn(algorithm), loss_weight_fn=loss_weight_fn(algorithm)
            ).result()
            await backend.optim_step().result()
        metrics = await backend.forward_backward(
            examples, loss_fn=rl_loss_fn(algorithm), loss_weight_fn=loss_weight_fn(algorithm)
        ).result()
    grads = await backend.full_grads().result()
    save_file({k: v.contiguous() for k, v in grads.items()}, str(out / "grads.safetensors"))
    (out / "metrics.json").write_text(json.dumps(metrics))
    backend.close()
    return metrics


async def all_modes(model_dir: str, out: Path, modes: list[str]) -> None:
    for mode in modes:
        (out / mode).mkdir(parents=True, exist_ok=True)
        await one_step(model_dir, out / mode, mode)
        gc.collect()  # the dropped backend's cycles (FSDP's hooks): its model goes now


def main() -> int:
    model_dir, out, modes = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    run_rank0(BackendConfig(num_threads=1), lambda: trio.run(all_modes, model_dir, out, modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
