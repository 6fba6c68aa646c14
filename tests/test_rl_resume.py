"""RL resume restores everything a step depends on: the reference model, its rule, the critic."""

from __future__ import annotations

import torch

from engines import EnginePool, SGLangEngine
from engines.local import open_local_engine
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import load_prompt_jsonl
from rollouts.tasks.arithmetic import digit_share_reward, write_arithmetic_datasets
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.data.buffer import DataBuffer
from training.loops.rl import run_rl_training
from training.rl.algorithms import ppo
from training.rl.batch import collate_rl
from training.rl.critic import make_critic
from training.rl.objective import RLObjective
from training.rl.reference import ema_update, kl_triggered_reset, make_reference
from training.rl_config import RLLoopConfig


class EmaCountingKL:
    """An EMA reference rule with state of its own (the KL it has seen), as a user might write."""

    def __init__(self):
        self.ema = ema_update(0.5)
        self.kl_seen = 0.0

    def state_dict(self):
        return {"kl_seen": self.kl_seen}

    def load_state_dict(self, state):
        self.kl_seen = state["kl_seen"]

    def __call__(self, reference, policy, step, metrics):
        self.ema(reference, policy, step, metrics)
        self.kl_seen += metrics["kl"]


async def run_steps(model_dir, tmp_path, rule, *, resume: bool):
    files = write_arithmetic_datasets(tmp_path / "data", n_sft=10, n_rl=64, n_eval=8, seed=0)
    model, tok = load_model_and_tokenizer(model_dir)
    buffer = DataBuffer(load_prompt_jsonl(files.rl_train, tok), seed=0)
    backend = PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=3e-3, schedule="constant"), max_steps=2,
        checkpoint_dir=tmp_path / "out" / "checkpoints", pack_length=None,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip
    reference = make_reference(backend)
    critic = make_critic(model_dir, tok, optim=OptimConfig(lr=3e-3), max_steps=2,
                         checkpoint_dir=tmp_path / "out" / "critic")  # fmt: skip
    rollout = RolloutConfig(batch_size=2, n_samples_per_prompt=4, filter_groups="none",
                            sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    loop = RLLoopConfig(max_steps=2, checkpoint_every=2, resume="auto" if resume else "never")
    with backend, reference, critic:
        async with (
            open_local_engine(model_dir, num_threads=1) as server,
            SGLangEngine(server.url) as engine,
            EnginePool([engine]) as pool,
        ):
            manager = AsyncRolloutManager(pool, buffer, rollout, reward_fn=digit_share_reward,
                                          current_version=lambda: backend.weight_version)  # fmt: skip
            history = await run_rl_training(
                backend, buffer, manager, [engine], loop,
                objective=RLObjective(ppo(kl_coef=0.05), reference=reference,
                                      reference_update=rule, critic=critic),
                export_dir=tmp_path / "out" / "weights",
            )  # fmt: skip
        weights = {k: v.clone() for k, v in reference.model.state_dict().items()}
        weights |= {f"critic.{k}": v.clone() for k, v in critic.model.state_dict().items()}
    return history, weights


async def test_resume_restores_the_reference_its_update_rule_and_the_critic(
    tiny_model_dir, tmp_path
):
    trained_rule = EmaCountingKL()
    history, saved = await run_steps(tiny_model_dir, tmp_path, trained_rule, resume=False)
    assert len(history) == 2 and trained_rule.kl_seen > 0
    initial, _ = load_model_and_tokenizer(tiny_model_dir)
    initial_weights = initial.state_dict()
    assert any(not torch.equal(saved[k], initial_weights[k]) for k in initial_weights)  # EMA
    assert saved["critic.score.weight"].abs().sum() > 0  # the critic's head was trained

    resumed_rule = EmaCountingKL()
    history, resumed = await run_steps(tiny_model_dir, tmp_path, resumed_rule, resume=True)
    assert history == []  # all steps were done: resume only
    assert all(torch.equal(resumed[k], saved[k]) for k in saved)
    assert resumed_rule.kl_seen == trained_rule.kl_seen


def test_kl_triggered_reset_state_round_trips():
    rule = kl_triggered_reset(max_kl=10.0)
    rule(None, None, 1, {"kl": 0.25})
    rule(None, None, 2, {"kl": 0.5})
    fresh = kl_triggered_reset(max_kl=10.0)
    fresh.load_state_dict(rule.state_dict())
    assert fresh(None, None, 3, {"kl": 0.25})["reference_kl_accumulated"] == 1.0
