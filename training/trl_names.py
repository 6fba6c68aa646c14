"""TRL's config names and the rollouts keys that do the same job (docs/from-trl.md).

One table per TRL class. `config_hints` reads it when a config has an unknown key, so a TRL
YAML fed to `rollouts sft|rl` is answered with the rollouts name. tests/test_config.py checks
that every rollouts key named here exists in the config models, tests/test_docs.py that
docs/from-trl.md lists the same rows. Pure data: no torch, no pydantic.
"""

from __future__ import annotations

from typing import NamedTuple


class TRLKey(NamedTuple):
    """One TRL name: the rollouts keys that replace it (none: no equivalent) and how."""

    trl: str
    ours: tuple[str, ...]
    note: str = ""


def _k(trl: str, ours: str | tuple[str, ...], note: str = "") -> TRLKey:
    return TRLKey(trl, (ours,) if isinstance(ours, str) else ours, note)


NONE: tuple[str, ...] = ()
OVR = "algorithm.overrides."  # keys of the algorithm (training/rl/algorithm_config.py)

TRL_TABLES: dict[str, tuple[TRLKey, ...]] = {
    "TrainingArguments": (
        _k("output_dir", "output_dir"),
        _k("learning_rate", "optim.lr"),
        _k("lr_scheduler_type", "optim.schedule",
           "cosine or constant; cosine ends at optim.min_lr_ratio x lr, TRL's at 0"),
        _k("warmup_steps", "optim.warmup_steps"),
        _k("warmup_ratio", "optim.warmup_steps", "in steps: warmup_ratio x train.max_steps"),
        _k("weight_decay", "optim.weight_decay"),
        _k("max_grad_norm", "optim.grad_clip"),
        _k("adam_beta1", "optim.betas", "a pair: [adam_beta1, adam_beta2]"),
        _k("adam_beta2", "optim.betas", "a pair: [adam_beta1, adam_beta2]"),
        _k("adam_epsilon", "optim.eps"),
        _k("optim", "optim.name", "adamw or sgd; adamw_torch_fused is adamw with optim.fused"),
        _k("max_steps", "train.max_steps"),
        _k("gradient_accumulation_steps", "backend.micro_batch_tokens",
           "micro-batches are cut by this token budget; a step's batch, train.batch_size or "
           "rollout.batch_size, is whole"),
        _k("logging_steps", "train.log_every"),
        _k("save_steps", "train.checkpoint_every"),
        _k("save_total_limit", "train.keep_last"),
        _k("eval_steps", "train.eval_every"),
        _k("resume_from_checkpoint", "train.resume", "auto, as --resume does, or never"),
        _k("seed", "backend.seed"),
        _k("bf16", "model.dtype",
           "true: bfloat16; under torchrun, backend.fsdp.param_dtype=bfloat16 keeps fp32 weights"),
        _k("fp16", NONE, "float16 training is not offered; use model.dtype: bfloat16"),
        _k("use_cpu", "backend.device", "cpu is the default; cuda for a GPU"),
        _k("gradient_checkpointing", "backend.fsdp.activation_checkpointing",
           "on the FSDP2 path: torchrun, or backend.fsdp.at_world_size_1"),
        _k("report_to", ("logging.wandb", "logging.tensorboard"),
           "a section per logger: logging.wandb.project=NAME, logging.tensorboard={}"),
        _k("run_name", "logging.wandb.name"),
        _k("fsdp", "backend.fsdp",
           "FSDP2 is on whenever torchrun starts more than one process; options in backend.fsdp"),
        _k("deepspeed", NONE, "training shards with FSDP2 under torchrun: docs/gpus.md"),
        _k("eval_strategy", NONE, "evaluation runs every train.eval_every steps"),
        _k("save_strategy", NONE, "checkpoints every train.checkpoint_every steps"),
        _k("per_device_eval_batch_size", NONE, "eval batches are sized by the engine or backend"),
        _k("push_to_hub", NONE, "checkpoints are HF directories: upload one with huggingface-cli"),
    ),
    "SFTConfig": (
        _k("num_train_epochs", "train.epochs"),
        _k("per_device_train_batch_size", "train.batch_size",
           "train.batch_size counts every sample of a step: per_device_train_batch_size x "
           "gradient_accumulation_steps x processes"),
        _k("max_length", "data.max_seq_len", "null: the longest record"),
        _k("max_seq_length", "data.max_seq_len", "older TRL's name for max_length"),
        _k("packing", "data.packing", "rows of data.pack_length; no attention across samples"),
        _k("dataset_text_field", NONE,
           "records are chat `messages` or `prompt`/`completion` lines: docs/data-formats.md"),
        _k("completion_only_loss", NONE, "always: prompt tokens carry no loss"),
        _k("assistant_only_loss", NONE, "always: only assistant tokens carry loss"),
        _k("dataset_num_proc", NONE, "tokenization runs in the training process"),
    ),
    "GRPOConfig": (
        _k("num_train_epochs", NONE,
           "an RL run lasts train.max_steps; the prompts start a new epoch by themselves"),
        _k("per_device_train_batch_size", "rollout.batch_size",
           "prompts per step: TRL's completions per step / num_generations"),
        _k("generation_batch_size", "rollout.batch_size", "in prompts: / num_generations"),
        _k("steps_per_generation", "train.mini_batches",
           "optimizer steps per rollout batch (whole groups each)"),
        _k("num_iterations", "train.epochs", "passes over each rollout batch"),
        _k("num_generations", "rollout.n_samples_per_prompt"),
        _k("max_prompt_length", "data.max_prompt_len"),
        _k("max_completion_length", "rollout.sampling.max_new_tokens"),
        _k("temperature", "rollout.sampling.temperature"),
        _k("top_p", "rollout.sampling.top_p"),
        _k("top_k", "rollout.sampling.top_k", "-1: off; TRL: 0 or null"),
        _k("beta", OVR + "kl_coef", "k3 KL to a frozen reference; 0: no reference model"),
        _k("epsilon", OVR + "clip_low"),
        _k("epsilon_high", OVR + "clip_high", "TRL defaults it to epsilon; here it is 0.2"),
        _k("delta", OVR + "dual_clip",
           "bounds the loss of negative advantages at the ratio delta"),
        _k("loss_type", OVR + "aggregation",
           "grpo: seq-mean-token-mean; bnpo or dapo: token-mean; dr_grpo: algorithm.preset=dr_grpo"),
        _k("scale_rewards", OVR + "scale_by_std", "group/true: true; none/false: false; batch: no equivalent"),
        _k("importance_sampling_level", "algorithm.preset", "sequence: gspo"),
        _k("mask_truncated_completions", OVR + "mask_truncated"),
        _k("vllm_importance_sampling_cap", OVR + "is_cap",
           "truncated IS against the engines' logprobs"),
        _k("reward_funcs", "reward.fn",
           "one module:function; several: rollouts.rewards.vector_reward, each part logged"),
        _k("reward_weights", NONE, "vector_reward(parts, weighted_sum(weights)) as reward.fn"),
        _k("use_vllm", "engines.kind",
           "generation always runs on engines: the local one, SGLang, or vllm with engines.urls"),
        _k("vllm_server_base_url", "engines.urls"),
        _k("vllm_mode", NONE, "engines are servers of their own, as in TRL's server mode"),
        _k("log_completions", "train.dump_rollouts", "every sample to rollouts.jsonl"),
        _k("sync_ref_model", NONE,
           "pass a reference_update: ema_update or periodic_reset, training/rl/reference.py"),
        _k("shuffle_dataset", "data.shuffle_seed", "prompts are always shuffled, per epoch"),
    ),
    "OnlineDPOConfig": (
        _k("beta", OVR + "dpo_beta", "with algorithm.preset=online_dpo"),
        _k("max_new_tokens", "rollout.sampling.max_new_tokens"),
        _k("judge", "reward.fn", "best vs worst of each group by the reward"),
        _k("missing_eos_penalty", NONE, "give truncated samples a lower reward in reward.fn"),
    ),
    "ModelConfig": (
        _k("model_name_or_path", "model.path"),
        _k("torch_dtype", "model.dtype"),
        _k("dtype", "model.dtype"),
        _k("use_peft", "model.lora", "a model.lora section turns LoRA on: model.lora.rank=N"),
        _k("lora_r", "model.lora.rank"),
        _k("lora_alpha", "model.lora.alpha"),
        _k("lora_dropout", "model.lora.dropout"),
        _k("lora_target_modules", "model.lora.target_modules"),
    ),
    "ScriptArguments": (
        _k("dataset_name", "data.train_path", "a local JSONL; save a Hub dataset as JSONL first"),
    ),
    "LoraConfig": (
        _k("r", "model.lora.rank"),
        _k("lora_alpha", "model.lora.alpha"),
        _k("lora_dropout", "model.lora.dropout"),
        _k("target_modules", "model.lora.target_modules", "a list, or all-linear"),
        _k("task_type", NONE, "always a causal LM"),
    ),
}  # fmt: skip

_COMMON = ("TrainingArguments", "ModelConfig", "ScriptArguments", "LoraConfig")
SFT_TABLES = ("SFTConfig", *_COMMON)  # the TRL classes an SFT config's unknown keys come from
RL_TABLES = ("GRPOConfig", "OnlineDPOConfig", *_COMMON)


def trl_names(key: str, tables: tuple[str, ...]) -> list[tuple[str, TRLKey]]:
    """The entries of `tables` whose TRL name is `key`, as (table, entry)."""
    return [(t, e) for t in tables for e in TRL_TABLES[t] if e.trl == key]
