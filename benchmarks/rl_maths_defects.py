"""The five RL-maths defects of issue 13, measured: run from a tree's root to print its figures.

    .venv/bin/python benchmarks/rl_maths_defects.py     # this tree
    (cd <an older checkout> && <venv>/bin/python <this file>)   # the same figures before a fix

Each line is one defect's figure (tests/test_rl_maths.py pins the properties). Builds its own
tiny model in a temporary directory. Self-contained on purpose (its few builders repeat
tests/rl_helpers.py): it must run inside older checkouts, which have no such helpers.
"""

import sys
import tempfile
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path.cwd()))
import training.recipes.rl as recipe
from rollouts.types import RolloutBatch, Sample
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.backend.tiny_model import build_tiny_model
from training.config import OptimConfig, load_config
from training.loops.rl import train_on_batch
from training.rl.algorithms import (
    compute_advantages,
    compute_policy_loss,
    dr_grpo,
    grpo,
    online_dpo,
    reinforce,
    shape_reward,
)
from training.rl.batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn
from training.rl.reference import make_reference
from training.rl_config import RLRunConfig


def backend(tmp, mbt=8192):
    m, tok = load_model_and_tokenizer(MODEL)
    return PyTorchTrainingBackend(
        m,
        tok,
        optim=OptimConfig(lr=1e-3, schedule="constant"),
        max_steps=4,
        checkpoint_dir=Path(tmp) / "c",
        pack_length=None,
        micro_batch_tokens=mbt,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )


def scored(g, i, r, n=4):
    resp = tuple(7 + (i + k + g) % 11 for k in range(n))
    return Sample((5, 6, 8 + g), resp, (1,) * n, group_id=g, index_in_group=i).with_reward(r)


def batch_of(rows, n=lambda g, i: 4):
    return RolloutBatch(
        tuple(
            tuple(scored(g, i, r, n(g, i)) for i, r in enumerate(row)) for g, row in enumerate(rows)
        ),
        1,
        0,
    )


async def main():
    tmp = tempfile.mkdtemp()
    global MODEL
    MODEL = build_tiny_model(Path(tmp) / "tiny", seed=0)
    eq = batch_of([[1.0] * 4, [0.5] * 4])
    for kar in (False, True):
        with backend(tmp) as p, make_reference(p) as r:
            m = await train_on_batch(
                p,
                eq,
                grpo(kl_coef=0.1, kl_as_reward=kar),
                temperature=0.7,
                old_from_rollout=False,
                reference=r,
            )
        print(
            f"1. T=0.7 reference=policy, kl_as_reward={kar}: kl={m['kl']:.4g} grad_norm={m['grad_norm']:.4g}"
        )
    with backend(tmp) as p, make_reference(p) as r:
        m = await train_on_batch(
            p,
            batch_of([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.2]]),
            online_dpo(),
            temperature=0.7,
            old_from_rollout=False,
            reference=r,
        )
    print(f"1. online DPO margin, reference=policy, T=0.7: {m['reward_margin']:.4g}")
    cfg = load_config(RLRunConfig, "configs/tool_tiny.yaml", ["algorithm.preset=dapo"])
    budget = (
        recipe.generation_budget(cfg)
        if hasattr(recipe, "generation_budget")
        else cfg.rollout.sampling.max_new_tokens
    )
    algo = recipe.algorithm_schedule(cfg.algorithm, budget)(1)
    mask = (1,) * 15 + (0,) * 14 + (1,) * 15
    ep = Sample((5, 6), tuple(range(10, 10 + len(mask))), mask)
    print(
        f"2. DAPO, tool_tiny, correct 44-token episode (30 sampled): reward {shape_reward(algo, lambda s: 1.0)(ep)['total']:.3g} (limit {algo.overlong.max_response_len})"
    )
    adv = compute_advantages(grpo(), torch.full((1, 8), 1.2))
    print(
        f"3. GRPO advantages of 8 x 1.2: {adv[0, 0].item():.4g} (max |A| {adv.abs().max().item():.4g})"
    )
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    for _ in range(1000):
        r = torch.full((1, 8), float(torch.rand(1, generator=gen) * 10))
        worst = max(worst, compute_advantages(grpo(), r).abs().max().item())
    print(f"3. worst |A| over 1000 random constant groups: {worst:.4g}")
    try:
        algo = dr_grpo()
        lengths = [3, 9, 5, 12, 4, 7, 10, 6]
        b = batch_of(
            [[1.0, 0.0, 0.3, 0.7], [0.2, 0.9, 0.0, 1.0]], n=lambda g, i: lengths[4 * g + i]
        )
        ex = build_examples(b, algo, share_prompts=False)
        grads = []
        for mbt in (8192, 40):
            with backend(tmp, mbt) as p:
                m = await p.forward_backward(
                    ex, loss_fn=rl_loss_fn(algo), loss_weight_fn=loss_weight_fn(algo)
                ).result()
                grads.append(
                    await p.call(
                        lambda: torch.cat(
                            [q.grad.flatten() for q in p.model.parameters() if q.grad is not None]
                        )
                    ).result()
                )
            print(f"   micro-batches: {m['n_microbatches']}")
        print(
            f"4. Dr.GRPO (Python default) gradient change, 1 vs 3 micro-batches: {((grads[1] - grads[0]).norm() / grads[0].norm()).item():.1%}"
        )
    except Exception as e:
        print(f"4. dr_grpo() without max_tokens_norm: {type(e).__name__}: {str(e)[:160]}")
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)

    def g(old):
        lp.grad = None
        loss, _ = compute_policy_loss(
            reinforce(is_cap=2.0), lp, old, torch.tensor([1.0]), torch.ones(1, 3)
        )
        loss.backward()
        return lp.grad.clone()

    print(
        f"5. off-policy REINFORCE, gradient of a 2-nat-stale sample / on-policy (is_cap=2): {(g(lp.detach() - 2) / g(lp.detach()))[0, 0].item():.3g}"
    )


trio.run(main)
