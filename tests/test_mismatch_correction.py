"""The engine/trainer mismatch corrections (issue 46, item 1): each one is its paper's formula.

Per correction (training/rl/mismatch.py): the loss value and gradient equal the paper's
objective written out here in plain torch — on toy tensors (with PPO's clip active), and on
the tiny model through the real backend at two micro-batch budgets, against autograd on a plain
copy of the model (two ranks: tests/test_distributed_shapes.py, the mismatch cases). The
statistics report a known injected mismatch exactly; the config refuses what it cannot do;
`is_cap` corrects the off-policy modes through the whole loop.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from plumbing.errors import ConfigError
from tests.rl_helpers import batch_of, grads_of, rl_backend
from tests.shape_cases import MISMATCH_KINDS, engine_offsets
from training.rl.algorithms import AlgorithmConfig, compute_policy_loss, grpo, online_dpo
from training.rl.batch import build_examples, loss_weight_fn, rl_loss_fn

OFFSETS = (0.0, 0.5, -0.3, 1.2, -0.9, 0.1, 2.0, -1.8)  # engine − trainer logprob; ratio e^−off
BOUNDS = {"tis": (None, 2.0), "mis": (0.5, 2.0), "icepop": (0.5, 5.0), "seq_tis": (None, 2.0),
          "seq_mis": (0.999, 1.001)}  # the papers' (docs/rl.md)  # fmt: skip


def paper_weights(kind: str, ratio_BT: torch.Tensor, mask_BT: torch.Tensor,
                  lo: float | None = None, hi: float | None = None) -> torch.Tensor:  # fmt: skip
    """Each paper's weight of a token, from the engine/trainer ratios, written out."""
    lo = BOUNDS[kind][0] if lo is None else lo
    hi = BOUNDS[kind][1] if hi is None else hi
    m = mask_BT.bool()
    if kind == "tis":  # Yao et al.: min(π_train / π_infer, C)
        w = torch.clamp(ratio_BT, max=hi)
    elif kind in ("mis", "icepop"):  # IcePop's M(k; α, β) = k on [α, β], else 0
        w = torch.where((ratio_BT >= lo) & (ratio_BT <= hi), ratio_BT, torch.zeros(()))
    else:  # ρ_i = exp(mean over the sequence's tokens of log ratio), on every token of it
        log_rho = (torch.log(ratio_BT) * m).sum(-1) / m.sum(-1)
        rho = torch.exp(log_rho)[:, None].expand_as(ratio_BT)
        w = (torch.clamp(rho, max=hi) if kind == "seq_tis"
             else torch.where((rho >= lo) & (rho <= hi), rho, torch.zeros(())))  # fmt: skip
    return w * m


def grpo_objective(logprobs_BT, old_BT, adv_B, mask_BT, w_BT, eps=0.2) -> torch.Tensor:
    """−J: GRPO's (and IcePop's) 1/G Σ_i 1/|y_i| Σ_t w_t · min(r_t A_i, clip(r_t, 1±ε) A_i)."""
    r = torch.exp(logprobs_BT - old_BT)
    a = adv_B[:, None]
    surrogate = torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps) * a)
    per_sequence = (w_BT * surrogate * mask_BT).sum(-1) / mask_BT.sum(-1)
    return -per_sequence.mean()


def toy():
    g = torch.Generator().manual_seed(3)
    mask_BT = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1] * 6, [1, 1, 1, 0, 0, 0]],
                           dtype=torch.float32)  # fmt: skip
    logprobs_BT = -torch.rand(4, 6, generator=g) * 3
    old_BT = logprobs_BT + 0.3 * torch.randn(4, 6, generator=g)  # PPO's clip is active
    off_BT = torch.tensor([[OFFSETS[(3 * b + t) % 8] for t in range(6)] for b in range(4)])
    off_BT[1] = 0.0  # a sequence that agrees exactly: ρ = 1
    return logprobs_BT, old_BT, old_BT + off_BT, torch.tensor([1.0, -0.5, 0.8, -1.2]), mask_BT


@pytest.mark.parametrize("kind", list(BOUNDS))
def test_each_correction_is_its_papers_objective_value_and_gradient(kind):
    logprobs_BT, old_BT, engine_BT, adv_B, mask_BT = toy()
    ratio_BT = torch.exp(old_BT - engine_BT)
    w_BT = paper_weights(kind, ratio_BT, mask_BT)
    assert 0 < (w_BT[mask_BT.bool()] != ratio_BT[mask_BT.bool()]).sum() < mask_BT.sum() - 1
    lp = logprobs_BT.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(grpo(mismatch=kind), lp, old_BT, adv_B, mask_BT,
                                        rollout_logprobs_BT=engine_BT)  # fmt: skip
    loss.backward()
    hand = logprobs_BT.clone().requires_grad_(True)
    expected = grpo_objective(hand, old_BT, adv_B, mask_BT, w_BT)
    expected.backward()
    assert metrics["clip_fraction"] > 0
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(lp.grad, hand.grad, rtol=1e-5, atol=1e-7)


def test_is_cap_is_token_level_truncated_is():
    logprobs_BT, old_BT, engine_BT, adv_B, mask_BT = toy()
    a, _ = compute_policy_loss(grpo(is_cap=1.5), logprobs_BT, old_BT, adv_B, mask_BT,
                               rollout_logprobs_BT=engine_BT)  # fmt: skip
    w_BT = paper_weights("tis", torch.exp(old_BT - engine_BT), mask_BT, hi=1.5)
    assert a.item() == pytest.approx(
        grpo_objective(logprobs_BT, old_BT, adv_B, mask_BT, w_BT).item()
    )


def injected(share_of: int):
    """Trainer logprobs and engine logprobs 0.5 nats above them on every `share_of`-th token."""
    logprobs_BT, _, _, _, mask_BT = toy()
    hit_BT = (torch.arange(24).view(4, 6) % share_of == 0) & mask_BT.bool()
    return logprobs_BT, logprobs_BT + 0.5 * hit_BT, mask_BT, hit_BT


@pytest.mark.parametrize("share_of", [1, 3, 4])
def test_the_statistics_report_an_injected_mismatch_exactly(share_of):
    """The engine 0.5 nats more sure (ratio e^−0.5 ≈ 0.61) on a known share of the tokens:
    outside [0.8, 1.25] is exactly that share, with or without a correction configured."""
    logprobs_BT, engine_BT, mask_BT, hit_BT = injected(share_of)
    share = (hit_BT.sum() / mask_BT.sum()).item()
    adv_B = torch.ones(4)
    metrics = compute_policy_loss(grpo(mismatch="mis", mismatch_lo=0.8, mismatch_hi=1.25),
                                  logprobs_BT, logprobs_BT, adv_B, mask_BT,
                                  rollout_logprobs_BT=engine_BT)[1]  # fmt: skip
    assert metrics["mismatch_outside_fraction"].item() == pytest.approx(share)
    assert metrics["mis_masked_fraction"].item() == pytest.approx(share)
    assert metrics["mismatch_ratio_min"].item() == pytest.approx(math.exp(-0.5))
    assert metrics["mismatch_ratio_mean"].item() == pytest.approx(1 - share * (1 - math.exp(-0.5)),
                                                                  rel=1e-5)  # fmt: skip
    n_B, hits_B = mask_BT.sum(-1), hit_BT.sum(-1)
    assert metrics["mismatch_seq_log_ratio_mean"].item() == pytest.approx(
        (-0.5 * hits_B / n_B).mean().item(), rel=1e-5)  # fmt: skip
    assert metrics["mismatch_seq_log_ratio_max_abs"].item() == pytest.approx(
        (0.5 * hits_B / n_B).max().item(), rel=1e-5)  # fmt: skip
    plain = compute_policy_loss(grpo(), logprobs_BT, logprobs_BT, adv_B, mask_BT,
                                rollout_logprobs_BT=engine_BT)[1]  # fmt: skip
    assert plain["mismatch_outside_fraction"].item() == 0.0  # e^−0.5 is inside [0.5, 2]
    none = compute_policy_loss(grpo(), logprobs_BT, logprobs_BT, adv_B, mask_BT,
                               rollout_logprobs_BT=logprobs_BT)[1]  # fmt: skip
    assert none["mismatch_ratio_max"].item() == none["mismatch_ratio_min"].item() == 1.0
    assert none["mismatch_kl_k3"].item() == 0.0 < plain["mismatch_kl_k3"].item()


def test_the_defaults_are_the_papers_bounds():
    assert tuple(BOUNDS) == MISMATCH_KINDS
    for kind, (lo, hi) in BOUNDS.items():
        correction = grpo(mismatch=kind).mismatch_correction
        assert (correction.lo, correction.hi) == (lo, hi)


def test_the_config_names_what_it_refuses():
    assert grpo(mismatch="icepop").mismatch_correction.bounds == (0.5, 5.0)
    assert grpo(mismatch="tis").mismatch_correction.bounds == (0.5, 2.0)
    assert grpo(is_cap=3.0).mismatch_correction.hi == 3.0
    with pytest.raises(ConfigError, match="not both"):
        grpo(is_cap=2.0, mismatch="mis")
    with pytest.raises(ConfigError, match="truncates from above only"):
        grpo(mismatch="tis", mismatch_lo=0.5)
    with pytest.raises(ConfigError, match="set mismatch"):
        grpo(mismatch_hi=3.0)
    with pytest.raises(ConfigError, match="must be below"):
        grpo(mismatch="mis", mismatch_lo=2.0, mismatch_hi=1.5)
    with pytest.raises(ConfigError, match="mismatch"):
        grpo(mismatch="geo")
    with pytest.raises(ConfigError, match="pairwise"):
        online_dpo(mismatch="icepop")
    with pytest.raises(ValueError, match="extra"):
        AlgorithmConfig(mismatch_kind="icepop")
    logprobs_BT, _, _, adv_B, mask_BT = toy()
    with pytest.raises(ConfigError, match="rollout_logprobs_BT"):
        compute_policy_loss(grpo(mismatch="mis"), logprobs_BT, logprobs_BT, adv_B, mask_BT)


def test_a_run_config_picks_a_correction_and_refuses_a_misspelt_one(tmp_path):
    from training.config import load_config
    from training.recipes.rl import algorithm_schedule
    from training.rl_config import RLRunConfig

    path = tmp_path / "rl.yaml"
    path.write_text("algorithm:\n  preset: dapo\n  overrides: {mismatch: icepop}\n")
    config = load_config(RLRunConfig, path, ["algorithm.overrides.mismatch_hi=4.0"])
    algorithm = algorithm_schedule(config.algorithm, budget=16)(1)
    assert algorithm.mismatch_correction.bounds == (0.5, 4.0)
    config = load_config(RLRunConfig, path, ["algorithm.overrides.mismatch=icepops"])
    with pytest.raises(ConfigError, match="icepop"):
        algorithm_schedule(config.algorithm, budget=16)


# ----- the real backend: the tiny model, micro-batched ------------------------------------------


def _length(g: int, i: int) -> int:
    return 1 + (5 * g + 3 * i) % 9


def model_logprobs(model, example) -> torch.Tensor:
    """Logprobs (with gradient) of `example`'s trained tokens under a plain model."""
    ids = torch.tensor([example.input_ids])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    positions = [t for t in range(1, len(example.input_ids)) if example.loss_mask[t]]
    return torch.stack([logprobs[t - 1, ids[0, t]] for t in positions])


def expected_grads(model, examples, kind: str) -> dict[str, torch.Tensor]:
    """The gradient of GRPO's objective with `kind`'s weights, by autograd on `model`."""
    model.zero_grad(set_to_none=True)
    lp_S = [model_logprobs(model, e) for e in examples]
    width = max(len(lp) for lp in lp_S)
    lp_BT, mask_BT, ratio_BT = (torch.zeros(len(lp_S), width) for _ in range(3))
    lp_BT = torch.stack([torch.cat([lp, lp.new_zeros(width - len(lp))]) for lp in lp_S])
    for j, lp in enumerate(lp_S):
        mask_BT[j, : len(lp)] = 1.0
        ratio_BT[j, : len(lp)] = torch.exp(-torch.tensor(engine_offsets(j, len(lp))))
    ratio_BT[mask_BT == 0] = 1.0
    w_BT = paper_weights(kind, ratio_BT, mask_BT)
    adv_B = torch.tensor([e.advantage for e in examples])
    grpo_objective(lp_BT, lp_BT.detach(), adv_B, mask_BT, w_BT).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def backend_runs(tiny_model_dir, tmp_path_factory):
    """{(kind, budget): (metrics, grads)} and the examples, from the real backend."""
    import trio

    batch = batch_of([[1.0, 0.0, 0.5, 0.2], [0.3, 0.9, 0.0, 0.6]], n_response=_length)

    async def run():
        out = {}
        for budget in (8192, 14):
            with rl_backend(tiny_model_dir, tmp_path_factory.mktemp("b"),
                            micro_batch_tokens=budget) as backend:  # fmt: skip
                examples = build_examples(batch, grpo(), share_prompts=False)
                trainer_S = await backend.compute_logprobs(examples).result()
                engine = [(lp + torch.tensor(engine_offsets(j, len(lp)))).tolist()
                          for j, lp in enumerate(trainer_S)]  # fmt: skip
                examples = [replace(e, rollout_logprobs=tuple(v)) for e, v in zip(examples, engine,
                                                                                   strict=True)]  # fmt: skip
                for kind in BOUNDS:
                    algorithm = grpo(mismatch=kind)
                    await backend.call(lambda: backend.model.zero_grad(set_to_none=True)).result()
                    metrics = await backend.forward_backward(
                        examples, loss_fn=rl_loss_fn(algorithm),
                        loss_weight_fn=loss_weight_fn(algorithm), dropout=False,
                    ).result()  # fmt: skip
                    out[kind, budget] = (metrics, await grads_of(backend))
        return out, examples

    return trio.run(run)


@pytest.mark.parametrize("kind", list(BOUNDS))
def test_each_correction_gives_its_papers_gradient_on_the_model_at_two_micro_batch_sizes(
    backend_runs, tiny_model_dir, kind
):
    from training.backend.pytorch import load_model_and_tokenizer

    runs, examples = backend_runs
    model = load_model_and_tokenizer(tiny_model_dir)[0].eval()
    expected = expected_grads(model, examples, kind)
    flat_expected = torch.cat([g.flatten() for g in expected.values()])
    for budget in (8192, 14):
        metrics, grads = runs[kind, budget]
        assert metrics["n_microbatches"] == 1 if budget == 8192 else metrics["n_microbatches"] >= 3
        flat = torch.cat([grads[n].flatten() for n in expected])
        torch.testing.assert_close(flat, flat_expected, rtol=1e-4,
                                   atol=1e-4 * flat_expected.abs().max().item())  # fmt: skip
    one, many = runs[kind, 8192][0], runs[kind, 14][0]
    for key in [k for k in one if k.startswith((kind, "mismatch_"))]:
        assert many[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    flag = "masked" if kind in ("mis", "icepop", "seq_mis") else "capped"
    assert 0 < one[f"{kind}_{flag}_fraction"] < 1


# ----- is_cap in the off-policy modes, through the loop ------------------------------------------


async def test_is_cap_corrects_the_overlap_mode_through_the_loop(local_engine, tiny_model_dir,
                                                                 tmp_path):  # fmt: skip
    """A review said grpo(is_cap=…) is inert off-policy and reports no tis_* metric. The maths
    says it must act: with old_from_rollout the engine sampled with older weights, and decoupled
    PPO weights each token by min(π_trainer / π_engine, cap) (the ratio and clip to the
    trainer's logprobs). In overlap mode, step 2 trains on samples drawn with step 1's weights:
    its TIS weights are those ratios (capped), not 1, and its statistics show the drift."""
    from rollouts.config import RolloutConfig, SamplingConfig
    from tests.rl_helpers import run_loop

    _, engine = local_engine
    cap = 1.5
    overlap = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                            mode="overlap", sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    run = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=2, rollout=overlap,
                         algorithm=grpo(is_cap=cap), old_from_rollout=True)  # fmt: skip
    first, second = run.history
    assert first["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # the same weights
    assert second["logprob_diff_mean_abs"] > 1e-2 and second["mismatch_kl_k3"] > 0
    assert abs(second["tis_weight_mean"] - 1.0) > 1e-2
    assert second["tis_weight_mean"] <= min(cap, second["mismatch_ratio_mean"]) + 1e-6


async def test_a_correction_without_engine_logprobs_is_refused_not_inert(tiny_model_dir, tmp_path):
    """Samples without engine logprobs (a source that returned none) under is_cap: the
    correction did nothing and no tis_* metric said so; now the step names the cause."""
    batch = batch_of([[1.0, 0.0], [0.0, 1.0]])  # no rollout_logprobs
    for name, algorithm in (("a", grpo(is_cap=2.0)), ("b", grpo(mismatch="icepop"))):
        with rl_backend(tiny_model_dir, tmp_path, name=name) as backend:  # (a failed op ends it)
            examples = build_examples(batch, algorithm, share_prompts=False)
            fut = backend.forward_backward(examples, loss_fn=rl_loss_fn(algorithm, old_from_rollout=True),
                                           loss_weight_fn=loss_weight_fn(algorithm))  # fmt: skip
            with pytest.raises(ConfigError, match="engine's logprobs"):
                await fut.result()
