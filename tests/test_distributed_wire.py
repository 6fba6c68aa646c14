"""The command channel's codec (training/distributed/wire.py): what rank 0 sends, the other
ranks rebuild exactly, without pickle; what cannot be rebuilt is refused with the fix."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from training.backend.pytorch import tempered_logprobs
from training.config import OptimConfig
from training.data.tokenize import TokenizedSample
from training.distributed import wire
from training.distributed.split import rank_shares
from training.recipes.rl import make_algorithm
from training.rl.batch import RLExample, loss_weight_fn, rl_loss_fn
from training.rl.critic import value_loss_fn

PRESETS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "reinforce",
           "ppo", "online_dpo"]  # fmt: skip


def roundtrip(obj):
    raw = wire.dumps(obj)
    json.loads(raw)  # plain JSON on the wire
    return wire.loads(raw)


def test_rows_configs_and_tensors_come_back_equal():
    sample = TokenizedSample(input_ids=(1, 2, 3), loss_mask=(0, 1, 1), source="f.jsonl:3")
    example = RLExample(input_ids=(5, 6, 7, 8, 9), loss_mask=(0, 0, 1, 1, 1), advantage=0.25,
                        rollout_logprobs=(-0.1, -0.2, -0.3), unit=3, shared_prefix_len=2,
                        old_logprobs=(-0.5, -0.25, -1.0))  # fmt: skip
    tensors = {"w": torch.randn(3, 4), "b": torch.arange(5).to(torch.bfloat16), "e": torch.zeros(0)}
    back = roundtrip([sample, example, OptimConfig(lr=3e-4), tensors, (1, "a", None)])
    assert back[0] == sample and back[1] == example and back[2] == OptimConfig(lr=3e-4)
    for key, t in tensors.items():
        assert back[3][key].dtype == t.dtype and torch.equal(back[3][key], t)
    assert back[4] == (1, "a", None)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_presets_loss_can_be_rebuilt_on_another_rank(preset):
    algorithm = make_algorithm(preset, {}, budget=64)
    for fn in (rl_loss_fn(algorithm, temperature=0.7), loss_weight_fn(algorithm),
               value_loss_fn(0.2)):  # fmt: skip
        back = roundtrip(fn)
        assert wire.encode(back) == wire.encode(fn)


def test_a_lambda_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="module-level function or class, or a functools.partial"):
        wire.dumps({"loss_fn": lambda logits, batch: logits.sum()})
    back = roundtrip(partial(tempered_logprobs, temperature=2.0))
    assert back.func is tempered_logprobs and back.keywords == {"temperature": 2.0}


def test_rank_shares_balance_tokens_and_keep_prompt_groups_whole():
    # 3 groups of 4 samples, each group sharing its 20-token prompt (one row per group)
    examples = [RLExample(input_ids=(1 + i // 4,) * 20 + (2,) * (3 + i),
                          loss_mask=(0,) * 20 + (1,) * (3 + i), advantage=0.0,
                          rollout_logprobs=(0.0,) * (3 + i), shared_prefix_len=20, group=i // 4)
                for i in range(12)]  # fmt: skip
    shares = rank_shares(examples, 2, packed=False)
    assert sorted(i for share in shares for i in share) == list(range(12))
    assert all(share == sorted(share) and share for share in shares)
    groups = [set(range(k, k + 4)) for k in range(0, 12, 4)]
    for group in groups:
        assert any(group <= set(share) for share in shares)
