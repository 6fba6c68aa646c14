"""RL recipe: the models a run trains — the policy backend, and the reference and critic its
algorithms need — built from the config.

Blocking (they load weights): from async code call them in a worker thread, as
`run_rl_recipe` (training/recipes/rl.py) does.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
from training.config import LoraSettings, OptimConfig
from training.rl import algorithms
from training.rl.batch import collate_rl
from training.rl.critic import make_critic
from training.rl.reference import make_reference
from training.rl_config import RLRunConfig


def rl_backend(model_path: str | Path, *, checkpoint_dir: str | Path, max_steps: int,
               optim: OptimConfig | None = None, tokenizer: Any = None,
               micro_batch_tokens: int | str = "auto", keep_last: int | None = 2,
               num_threads: int | None = None, seed: int = 0, dtype: str = "float32",
               device: str = "cpu", lora: LoraSettings | None = None,
               attention: str = "sdpa", auto_reserve_params: float = 0.0,
               ) -> PyTorchTrainingBackend:  # fmt: skip
    """A `PyTorchTrainingBackend` that trains on RL batches (what `run_rl_training` needs).

    RL examples are one row per sample (or per group sharing a prompt), never packed SFT rows,
    so the backend batches with `collate_rl` and `pack_length=None`. Blocking (loads the
    model): from async code call it in a worker thread.

    Args:
        model_path: an HF model directory (or hub id); the tokenizer is loaded from it unless
            given.
        checkpoint_dir: where checkpoints go (and where resume looks).
        max_steps: the run's length (the LR schedule's horizon).
        optim: optimizer settings (default `OptimConfig()`).
        lora: train LoRA adapters on the model instead of all its weights (`model.lora`).
        attention: "sdpa", or "segments", the padding-free attention (`model.attention`).
        auto_reserve_params: with `micro_batch_tokens="auto"`, memory left for models built on
            the device later, in multiples of this model's parameter bytes.
    """
    tokenizer = load_tokenizer(model_path) if tokenizer is None else tokenizer
    pad_id = tokenizer.pad_token_id
    return PyTorchTrainingBackend(
        partial(load_model, str(model_path), dtype=dtype, device=device, attention=attention),
        tokenizer,
        optim=optim or OptimConfig(), max_steps=max_steps, checkpoint_dir=checkpoint_dir,
        micro_batch_tokens=micro_batch_tokens, pack_length=None,
        collate_fn=partial(collate_rl, pad_id=pad_id), keep_last=keep_last,
        num_threads=num_threads, seed=seed, lora=lora, auto_reserve_params=auto_reserve_params,
    )  # fmt: skip


def build_rl_models(config: RLRunConfig, model_path: str, tokenizer: Any,
                    schedule: algorithms.AlgorithmSchedule) -> tuple[Any, Any, Any]:  # fmt: skip
    """(policy backend, reference or None, critic or None), as the schedule's algorithms need.

    Blocking (loads model copies): call it in a worker thread from async code.
    """
    out = Path(config.output_dir)
    # exact logprobs: each sample is a micro-batch of its own (a budget of one token), scored
    # alone as the engine scores it (training/data/exact_scoring.py)
    micro_batch_tokens = 1 if config.engines.exact_logprobs else config.backend.micro_batch_tokens
    steps = range(1, config.train.max_steps + 1)
    needs_ref = any(schedule(s, {}).needs_ref_logprobs for s in steps)
    needs_critic = any(schedule(s, {}).needs_critic for s in steps)
    # `auto` chooses once the policy is built, before these: leave room for a reference (a copy
    # of the weights; none for LoRA) and a critic (weights, gradients, two AdamW moments)
    copy = needs_ref and config.model.lora is None
    backend = rl_backend(model_path, tokenizer=tokenizer, optim=config.optim,
                         max_steps=config.train.max_steps, checkpoint_dir=out / "checkpoints",
                         micro_batch_tokens=micro_batch_tokens,
                         keep_last=config.train.keep_last, num_threads=config.backend.num_threads,
                         seed=config.backend.seed, dtype=config.model.dtype,
                         attention=config.model.attention,
                         device=config.backend.device, lora=config.model.lora,
                         auto_reserve_params=float(copy) + 4.0 * needs_critic)  # fmt: skip
    reference = make_reference(backend) if needs_ref else None
    critic = None
    if needs_critic:
        # the critic's `auto` leaves room for the policy's gradients and AdamW moments, not
        # allocated yet (LoRA's are small)
        critic_optim = config.critic_optim or config.optim.model_copy(
            update={"lr": config.optim.lr * 10}
        )
        critic = make_critic(model_path, tokenizer, optim=critic_optim,
                             max_steps=config.train.max_steps, checkpoint_dir=out / "critic",
                             micro_batch_tokens=config.backend.micro_batch_tokens,
                             keep_last=config.train.keep_last,
                             num_threads=config.backend.num_threads, dtype=config.model.dtype,
                             device=config.backend.device,
                             auto_reserve_params=3.0 * (config.model.lora is None))  # fmt: skip
    return backend, reference, critic
