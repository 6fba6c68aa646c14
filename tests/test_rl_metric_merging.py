"""A step's loss metrics do not depend on how its batch is cut into micro-batches (issue 42).

The backend runs a step's loss on each micro-batch and merges the metrics: every metric by its
own rule (the extreme for `*_max*` / `*_min*`, a sum for counts, a mean weighted by its own
units: trained tokens, sequences or pairs, or the loss's weights). The property, for every
metric the RL losses emit under every algorithm: one micro-batch gives the same numbers as
many. The emitted names are enumerated, so a new metric must be added here and is then held
to the property. Real backend, the tiny model, one step's forward_backward at two budgets.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.rl_helpers import batch_of, rl_backend
from training.rl.algorithms import cispo, dapo, dr_grpo, grpo, gspo, online_dpo, reinforce
from training.rl.batch import build_examples, with_old_logprobs, with_ref_logprobs
from training.rl.microbatch_loss import loss_weight_fn, rl_loss_fn

# group 2 ties (no DPO pair): 3 true pairs; response lengths 2..9 (token and sequence means differ)
REWARDS_GN = [
    [0.0, 1.0, 0.5, 0.2],
    [0.9, 0.1, 0.3, 0.3],
    [0.4, 0.4, 0.4, 0.4],
    [1.0, 0.0, 0.6, 0.7],
]
TRUE_PAIRS = sum(max(row) > min(row) for row in REWARDS_GN)


def _length(g: int, i: int) -> int:
    return 2 + (3 * g + 5 * i) % 8


def _noise(k: int, scale: float) -> float:
    return scale * math.sin(1.7 * k + 0.3)


def _batch():
    """The batch, with engine logprobs that differ from the trainer's (mismatch, TIS)."""
    batch = batch_of(REWARDS_GN, n_response=_length)
    groups = tuple(
        tuple(replace(s, rollout_logprobs=tuple(-6.0 + _noise(7 * g + 3 * i + k, 1.5)
                                                for k in range(len(s.response_ids))))
              for i, s in enumerate(group))
        for g, group in enumerate(batch.groups)
    )  # fmt: skip
    return replace(batch, groups=groups)


CASES = {  # name: (algorithm, old_from_rollout)
    "grpo_tis": (grpo(is_cap=2.0), False),
    "grpo_kl_entropy_dual": (grpo(kl_coef=0.1, entropy_coef=0.01, dual_clip=1.2), False),
    "grpo_engine_as_old": (grpo(), True),
    "gspo": (gspo(clip_low=0.05, clip_high=0.05), False),
    "cispo": (cispo(), False),
    "reinforce_is": (reinforce(is_cap=1.2), False),
    "dr_grpo": (dr_grpo(max_tokens_norm=16), False),
    "dapo": (dapo(max_response_len=16), False),
    "online_dpo": (online_dpo(), False),
    "mis": (grpo(mismatch="mis"), False),
    "icepop_gspo": (gspo(clip_low=0.05, clip_high=0.05, mismatch="icepop"), False),
    "seq_tis": (cispo(mismatch="seq_tis", mismatch_hi=1.5), False),
    "seq_mis_dapo": (
        dapo(max_response_len=16, mismatch="seq_mis", mismatch_lo=1.0, mismatch_hi=50.0),
        False,
    ),
}

EMITTED = {
    "loss", "policy_loss", "entropy_estimate", "kl_to_old", "ratio_mean", "ratio_min",
    "ratio_max", "clip_fraction", "clip_fraction_high", "clip_fraction_low",
    "clip_fraction_dual", "logprob_diff_mean_abs", "logprob_diff_max_abs", "tis_weight_mean",
    "tis_capped_fraction", "kl", "entropy", "seq_ratio_mean", "cispo_weight_mean",
    "pg_is_weight_mean", "pg_is_capped_fraction", "num_pairs", "preference_accuracy",
    "reward_margin", "n_samples", "n_tokens", "n_trained_tokens",
    "mismatch_ratio_mean", "mismatch_ratio_max", "mismatch_ratio_min", "mismatch_kl_k3",
    "mismatch_outside_fraction", "mismatch_seq_outside_fraction", "mismatch_seq_log_ratio_mean",
    "mismatch_seq_log_ratio_max_abs", "mis_weight_mean", "mis_masked_fraction",
    "icepop_weight_mean", "icepop_masked_fraction", "seq_tis_weight_mean",
    "seq_tis_capped_fraction", "seq_mis_weight_mean", "seq_mis_masked_fraction",
}  # fmt: skip
DEPEND_ON_SPLIT = {"n_microbatches", "padding_efficiency", "time_forward_backward_s"}


async def _metrics_at(backend, algorithm, old_from_rollout: bool) -> dict[str, float]:
    examples = build_examples(_batch(), algorithm, share_prompts=False)  # a row per sample
    lp_S = await backend.compute_logprobs(examples).result()

    # the trainer's before-update and the reference's logprobs: near the current ones
    def shift(scale: float) -> list[torch.Tensor]:
        return [lp + torch.tensor([_noise(31 * j + k, scale) for k in range(len(lp))])
                for j, lp in enumerate(lp_S)]  # fmt: skip

    examples = with_ref_logprobs(with_old_logprobs(examples, shift(0.4)), shift(0.3))
    loss_fn = rl_loss_fn(algorithm, old_from_rollout=old_from_rollout)
    fut = backend.forward_backward(examples, loss_fn=loss_fn,
                                   loss_weight_fn=loss_weight_fn(algorithm), dropout=False)  # fmt: skip
    return await fut.result()


@pytest.fixture(scope="module")
def metrics_by_budget(tiny_model_dir, tmp_path_factory):
    """{budget: {case: metrics}} at one micro-batch and at one or two rows a micro-batch."""
    import trio

    async def run():
        out = {}
        for budget in (8192, 14):
            backend = rl_backend(tiny_model_dir, tmp_path_factory.mktemp("m"),
                                 micro_batch_tokens=budget)  # fmt: skip
            with backend:
                out[budget] = {name: await _metrics_at(backend, *case)
                               for name, case in CASES.items()}  # fmt: skip
        return out

    return trio.run(run)


def test_every_loss_metric_is_the_same_at_one_and_at_many_micro_batches(metrics_by_budget):
    one, many = metrics_by_budget[8192], metrics_by_budget[14]
    emitted = set().union(*(m.keys() for m in one.values())) - DEPEND_ON_SPLIT
    assert emitted == EMITTED, "a metric was added or removed: list it in EMITTED"
    differ = []
    for name in CASES:
        assert one[name]["n_microbatches"] == 1 and many[name]["n_microbatches"] >= TRUE_PAIRS
        for key in one[name].keys() - DEPEND_ON_SPLIT:
            a, b = one[name][key], many[name][key]
            if abs(a - b) > 1e-5 * abs(a) + 1e-6:
                differ.append(f"{name}.{key}: {a:.6g} at 1 micro-batch, {b:.6g} at "
                              f"{many[name]['n_microbatches']}")  # fmt: skip
    assert differ == []


def test_the_metrics_are_not_trivial(metrics_by_budget):
    """The cases exercise what the merge rules are for: spreads, clipping, mismatch, TIS."""
    one = metrics_by_budget[8192]
    tis = one["grpo_tis"]
    assert tis["logprob_diff_max_abs"] > tis["logprob_diff_mean_abs"] > 0
    assert 0 < tis["tis_capped_fraction"] < 1 and tis["ratio_min"] < 1 < tis["ratio_max"]
    assert 0 < tis["clip_fraction"] < 1 and 0 < one["reinforce_is"]["pg_is_capped_fraction"] < 1
    assert 0 < one["gspo"]["clip_fraction"] < 1
    assert one["grpo_kl_entropy_dual"]["clip_fraction_dual"] > 0
    for case, kind, flag in (("mis", "mis", "masked"), ("icepop_gspo", "icepop", "masked"),
                             ("seq_tis", "seq_tis", "capped"),
                             ("seq_mis_dapo", "seq_mis", "masked")):  # fmt: skip
        assert 0 < one[case][f"{kind}_{flag}_fraction"] < 1, case
        assert 0 < one[case]["mismatch_seq_outside_fraction"] < 1, case


def test_online_dpo_num_pairs_is_the_true_pair_count_at_any_micro_batch_size(metrics_by_budget):
    """Issue 42, W5: it was averaged over micro-batches (5 pairs reported as 1.4 / 1.8 / 5)."""
    assert TRUE_PAIRS == 3
    for budget, by_case in metrics_by_budget.items():
        assert by_case["online_dpo"]["num_pairs"] == TRUE_PAIRS, budget
