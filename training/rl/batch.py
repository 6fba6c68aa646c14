"""From rollout groups to training tensors (pure functions).

Token ids and engine logprobs travel untouched from the engine: an `RLExample` is the sample's
prompt + response ids with the loss mask extended by zeros over the prompt. RL batches are not
packed: sequence-level quantities (advantages, GSPO's ratio, seq-mean aggregation) need one
sequence per row, and RL responses in a batch have similar lengths. The model may still see
fewer rows: by default the samples of a group are scored against one shared copy of their
prompt (training/data/prefix_sharing.py), and the logits come back one sample per row.

Logprob alignment: position t of a row predicts token t+1, so a response token's logprob, its
engine logprob and its advantage all sit at the position just before it (where
`target_ids != -100`).

The per-micro-batch RL loss that consumes these tensors is in microbatch_loss.py; its names
stay importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import compress, pairwise

import torch

from plumbing.errors import ConfigError
from plumbing.gc_pause import gc_paused
from rollouts.shaping import add_reward_component
from rollouts.token_arrays import TokenArray
from rollouts.types import RolloutBatch, Sample
from training.data.packing import IGNORE_INDEX, SFTBatch, move_to
from training.data.prefix_sharing import prepare_prefix_shared_batch
from training.rl.advantages import AdvantageFn
from training.rl.algorithms import (
    AlgorithmConfig,
    apply_kl_reward_penalty,
    compute_advantages,
)
from training.rl.distill import sample_token_advantages
from training.rl.example_arrays import all_token_arrays, example_arrays, frozen_record
from training.rl.kl import KLFn
from training.rl.microbatch_loss import loss_weight_fn as loss_weight_fn
from training.rl.microbatch_loss import n_sequences as n_sequences
from training.rl.microbatch_loss import rl_loss_fn as rl_loss_fn
from training.rl.microbatch_loss import rl_microbatch_loss as rl_microbatch_loss
from training.rl.microbatch_loss import trained_tokens as trained_tokens
from training.rl.preference_loss import PairSelector, best_vs_worst


@dataclass(frozen=True)
class RLExample:
    """One sample as the trainer sees it."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    advantage: float
    rollout_logprobs: tuple[float, ...]  # one per trained (loss_mask == 1) response token
    ref_logprobs: tuple[float, ...] | None = None
    source: str = ""
    reward: float = 0.0
    unit: int | None = None  # examples sharing a unit stay in one micro-batch (DPO pairs)
    shared_prefix_len: int = 0  # leading tokens (the prompt) it may share a row for; 0: never
    group: int = -1  # index of its group in the batch; a mini-batch holds whole groups
    old_logprobs: tuple[float, ...] | None = None  # trainer's, before the first update
    token_advantages: tuple[float, ...] | None = None  # one per trained token (GAE), else None
    returns: tuple[float, ...] | None = None  # critic targets per trained token (PPO)
    old_values: tuple[float, ...] | None = None  # critic values before the update (PPO)

    @property
    def n_trained(self) -> int:
        mask = self.loss_mask
        return sum(mask) if type(mask) is not TokenArray else mask.sum()

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class RLBatch:
    """Tensors of one RL micro-batch; one sample per row (the model's input rows may hold a
    group with its prompt once: `base.source_index` maps them back, see prefix_sharing)."""

    base: SFTBatch
    advantages_B: torch.Tensor
    rollout_logprobs_BT: torch.Tensor | None
    ref_logprobs_BT: torch.Tensor | None
    rewards_GN: torch.Tensor | None = None  # [pairs, 2] for the pairwise (online DPO) loss
    old_logprobs_BT: torch.Tensor | None = None  # trainer's before the step's first update
    token_advantages_BT: torch.Tensor | None = None  # per-token advantages (GAE), else None
    returns_BT: torch.Tensor | None = None  # critic targets (PPO's value loss)
    old_values_BT: torch.Tensor | None = None  # critic values before the update

    @property
    def n_trained_tokens(self) -> int:
        return self.base.n_trained_tokens

    @property
    def n_samples(self) -> int:
        return self.base.n_samples

    @property
    def n_tokens(self) -> int:
        return self.base.n_tokens

    @property
    def n_slots(self) -> int:
        return self.base.n_slots

    @property
    def target_ids(self) -> torch.Tensor:
        return self.base.target_ids

    @property
    def input_ids(self) -> torch.Tensor:
        return self.base.input_ids

    @property
    def position_ids(self) -> torch.Tensor:
        return self.base.position_ids

    @property
    def attention_mask(self) -> torch.Tensor | None:
        return self.base.attention_mask

    @property
    def source_index(self) -> torch.Tensor | None:
        return self.base.source_index

    @property
    def is_packed(self) -> bool:
        return False

    @property
    def segment_lengths(self) -> tuple[int, ...]:
        return self.base.segment_lengths

    def to(self, device: torch.device | str) -> RLBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return move_to(t, device)

        return RLBatch(self.base.to(device), move(self.advantages_B),
                       move(self.rollout_logprobs_BT), move(self.ref_logprobs_BT),
                       move(self.rewards_GN), move(self.old_logprobs_BT),
                       move(self.token_advantages_BT), move(self.returns_BT),
                       move(self.old_values_BT))  # fmt: skip

    @property
    def segment_ids(self) -> torch.Tensor:
        return self.base.segment_ids


def sample_to_example(sample: Sample, advantage: float, *, unit: int | None = None,
                      share_prompt: bool = True, group: int = -1) -> RLExample:  # fmt: skip
    """The training view of one sample: prompt + response ids, mask 0 over the prompt.

    With `share_prompt`, neighbouring examples with the same prompt ids may be scored against
    one copy of it (training/data/prefix_sharing.py); the logprobs are the same either way.
    """
    if all_token_arrays((sample,)):  # a rollout worker's sample: numpy, not token by token
        (ids,), (mask,), (trained,) = example_arrays((sample,))
        return _example(sample, ids, mask, trained, advantage, unit, share_prompt, group)
    # C-level: a step at cluster scale has tens of millions of tokens (issue 31)
    trained = compress(sample.rollout_logprobs, sample.loss_mask)
    return RLExample(
        input_ids=sample.prompt_ids + sample.response_ids,
        loss_mask=(0,) * len(sample.prompt_ids) + sample.loss_mask,
        advantage=advantage,
        rollout_logprobs=tuple(trained),
        source=f"group {sample.group_id} sample {sample.index_in_group}",
        reward=sample.reward,
        unit=unit,
        shared_prefix_len=len(sample.prompt_ids) if share_prompt else 0,
        group=group,
    )


def _example(sample: Sample, ids: Sequence[int], mask: Sequence[int], trained: Sequence[float],
             advantage: float, unit: int | None, share_prompt: bool, group: int) -> RLExample:  # fmt: skip
    return frozen_record(RLExample, input_ids=ids, loss_mask=mask, advantage=advantage,
                         rollout_logprobs=trained, reward=sample.reward, unit=unit, group=group,
                         source=f"group {sample.group_id} sample {sample.index_in_group}",
                         shared_prefix_len=len(sample.prompt_ids) if share_prompt else 0)  # fmt: skip


def batch_rewards(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rewards [G, N] of a batch, and None, or padded to the largest group with its mask.

    Groups differ in size when an agent session branched (its other branches are extra
    samples of the group, `Sample.sub_index`); the mask is True on real samples.
    """
    sizes = {len(g) for g in batch.groups}
    if len(sizes) <= 1:
        return torch.tensor([[s.reward for s in g] for g in batch.groups],
                            dtype=torch.float32), None  # fmt: skip
    width = max(sizes)
    rewards_GN = torch.zeros(len(batch.groups), width)
    mask_GN = torch.zeros(len(batch.groups), width, dtype=torch.bool)
    for g, group in enumerate(batch.groups):
        rewards_GN[g, : len(group)] = torch.tensor([s.reward for s in group])
        mask_GN[g, : len(group)] = True
    return rewards_GN, mask_GN


def _padded(groups: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    return torch.tensor([[*g, *[0.0] * (width - len(g))] for g in groups], dtype=torch.float32)


def build_examples(batch: RolloutBatch, algorithm: AlgorithmConfig,
                   advantage_fn: AdvantageFn | None = None, *, share_prompts: bool = True,
                   pair_selector: PairSelector = best_vs_worst) -> list[RLExample]:  # fmt: skip
    """Advantages for every sample of `batch` under `algorithm`, as trainer examples (pure).

    Samples with no trained token (empty responses) are kept out: they carry no gradient, and
    so are truncated samples under `algorithm.mask_truncated`. For
    the pairwise loss (online DPO) each pair `pair_selector` picks in a group (default: its
    best and worst sample, none when they tie) is one unit, chosen first. `advantage_fn`,
    when given, replaces the algorithm's estimator (rewards [G, N] → advantages [G, N]); the
    built-in estimators also take groups of unequal size (`batch_rewards`), it does not.
    `share_prompts` lets the trainer score a group's samples against one copy of their prompt
    (same logprobs and gradients, less compute); False gives one model row per sample.
    """
    if algorithm.loss == "pairwise":
        return _preference_pairs(batch, share_prompts, pair_selector)
    rewards_GN, mask_GN = batch_rewards(batch)
    n_trained_GN = [[s.num_trained_tokens for s in g] for g in batch.groups]
    if advantage_fn is None and algorithm.needs_critic:  # per token, from the critic, later
        advantages_GN = torch.zeros_like(rewards_GN)
    elif advantage_fn is None:
        n_tokens_GN = _padded(n_trained_GN, rewards_GN.shape[1])
        advantages_GN = compute_advantages(algorithm, rewards_GN, n_tokens_GN=n_tokens_GN,
                                           mask_GN=mask_GN)  # fmt: skip
    elif mask_GN is not None:
        sizes = sorted({len(g) for g in batch.groups})
        raise ConfigError(
            f"advantage_fn: the batch's groups differ in size ({sizes} samples: agent "
            "sessions that branched, Sample.sub_index); a custom advantage_fn takes [G, N] "
            "rewards only: use a built-in estimator"
        )
    else:
        advantages_GN = advantage_fn(rewards_GN)
        if advantages_GN.shape != rewards_GN.shape:
            raise ValueError(
                f"advantage_fn returned shape {tuple(advantages_GN.shape)} for rewards of "
                f"shape {tuple(rewards_GN.shape)}; return one advantage per sample"
            )
    kept = [(g, n, s) for g, group in enumerate(batch.groups) for n, s in enumerate(group)
            if n_trained_GN[g][n]  # no trained token: no gradient
            and not (algorithm.mask_truncated and s.status == "truncated")]  # fmt: skip
    # (a truncated sample masked out still counted in its group's baseline, as in DAPO)
    advantages = advantages_GN[[g for g, _, _ in kept], [n for _, n, _ in kept]].tolist()
    samples = [s for _, _, s in kept]
    if all_token_arrays(samples):  # a rollout worker's: numpy over the batch, GC paused for
        with gc_paused():  # its tens of thousands of acyclic objects (plumbing/gc_pause.py)
            rows = zip(kept, advantages, *example_arrays(samples), strict=True)
            examples = [_example(s, ids, mask, lp, a, None, share_prompts, g)
                        for (g, _, s), a, ids, mask, lp in rows]  # fmt: skip
    else:
        examples = [sample_to_example(s, a, share_prompt=share_prompts, group=g)
                    for (g, _, s), a in zip(kept, advantages, strict=True)]  # fmt: skip
    if algorithm.needs_teacher:  # per token: the teacher's signal (distill.py)
        examples = [replace(e, token_advantages=sample_token_advantages(s, e.advantage, algorithm))
                    for e, (_, _, s) in zip(examples, kept, strict=True)]  # fmt: skip
    return examples


def _preference_pairs(batch: RolloutBatch, share_prompts: bool,
                      pair_selector: PairSelector) -> list[RLExample]:  # fmt: skip
    examples: list[RLExample] = []
    for g, group in enumerate(batch.groups):
        usable = [s for s in group if s.num_trained_tokens]
        for chosen, rejected in pair_selector([s.reward for s in usable], usable):
            unit = len(examples) // 2  # one unit per pair: both halves stay in one micro-batch
            examples += [
                sample_to_example(usable[chosen], 1.0, unit=unit, share_prompt=share_prompts,
                                  group=g),
                sample_to_example(usable[rejected], -1.0, unit=unit, share_prompt=share_prompts,
                                  group=g),
            ]  # fmt: skip
    return examples


def _with_per_token(examples: Sequence[RLExample], field: str,
                    values: Sequence[torch.Tensor]) -> list[RLExample]:  # fmt: skip
    pairs = zip(examples, values, strict=True)
    return [replace(e, **{field: tuple(v.tolist())}) for e, v in pairs]


def with_ref_logprobs(examples: Sequence[RLExample], ref_logprobs: Sequence[torch.Tensor]
                      ) -> list[RLExample]:  # fmt: skip
    """Attach reference-model logprobs of the same tokens (from `compute_logprobs`)."""
    return _with_per_token(examples, "ref_logprobs", ref_logprobs)


def with_old_logprobs(examples: Sequence[RLExample], old_logprobs: Sequence[torch.Tensor]
                      ) -> list[RLExample]:  # fmt: skip
    """Attach the trainer's logprobs before the step's first update (from `compute_logprobs`)."""
    return _with_per_token(examples, "old_logprobs", old_logprobs)


def split_mini_batches(examples: Sequence[RLExample], n: int) -> list[list[RLExample]]:
    """`examples` cut into at most `n` mini-batches of whole groups, in order, as even as can be.

    A group never straddles two optimizer steps: its advantages are relative to each other,
    and the pairwise loss needs both samples of a pair. Fewer groups than `n` give one
    mini-batch per group.
    """
    groups: list[list[RLExample]] = []
    for example in examples:
        if groups and groups[-1][0].group == example.group:
            groups[-1].append(example)
        else:
            groups.append([example])
    n = max(1, min(n, len(groups)))
    bounds = [round(k * len(groups) / n) for k in range(n + 1)]
    return [[e for g in groups[a:b] for e in g] for a, b in pairwise(bounds)]


def kl_penalised_batch(batch: RolloutBatch, algorithm: AlgorithmConfig,
                       logprobs_S: Sequence[torch.Tensor], ref_logprobs_S: Sequence[torch.Tensor],
                       *, kl_fn: KLFn | None = None) -> tuple[RolloutBatch, dict[str, float]]:  # fmt: skip
    """`batch` with kl_coef × Σ_t KL_t subtracted from each reward (KL as a reward penalty).

    `logprobs_S` / `ref_logprobs_S` are the policy's and the reference's logprobs of each
    sample's trained tokens, in `batch.samples` order (empty for samples with none), as
    `compute_logprobs` returns them. The penalty is kept on each sample as the "kl_penalty"
    reward component (an unscored sample's old reward becomes "task").

    Returns:
        (batch, metrics): "kl" (mean per-token KL) and "kl_reward_penalty_mean"; the batch
        unchanged and no metrics unless `algorithm.kl_as_reward` and `kl_coef > 0`.
    """
    samples = batch.samples
    if len(logprobs_S) != len(samples) or len(ref_logprobs_S) != len(samples):
        raise ValueError(
            f"kl_penalised_batch: {len(logprobs_S)} / {len(ref_logprobs_S)} logprob rows for "
            f"{len(samples)} samples; give one per sample, in batch order"
        )
    width = max((len(lp) for lp in logprobs_S), default=0)
    lp_BT, ref_BT, mask_BT = (torch.zeros(len(samples), width) for _ in range(3))
    for i, (lp, ref) in enumerate(zip(logprobs_S, ref_logprobs_S, strict=True)):
        lp_BT[i, : len(lp)], ref_BT[i, : len(ref)], mask_BT[i, : len(lp)] = lp, ref, 1.0
    # The penalty is per sequence: one row of all samples serves groups of any sizes.
    rewards_1B = torch.tensor([[s.reward for s in samples]], dtype=torch.float32)
    shaped_1B, metrics = apply_kl_reward_penalty(
        algorithm, rewards_1B, lp_BT, ref_BT, mask_BT, kl_fn=kl_fn
    )
    if not metrics:
        return batch, {}
    penalty_B = iter((shaped_1B - rewards_1B)[0].tolist())
    groups = tuple(tuple(add_reward_component(s, "kl_penalty", next(penalty_B)) for s in group)
                   for group in batch.groups)  # fmt: skip
    return replace(batch, groups=groups), metrics


def _scatter(base: SFTBatch, values: Sequence[Sequence[float]]) -> torch.Tensor:
    """Per-trained-token values of each sample at its trained positions ([B, T], one per row)."""
    out = torch.zeros(base.target_ids.shape, dtype=torch.float32)
    trained = base.target_ids != IGNORE_INDEX
    counts = trained.sum(dim=1).tolist()
    for i, (v, n) in enumerate(zip(values, counts, strict=True)):
        if n != len(v):
            raise ValueError(f"sample {i}: {len(v)} logprobs for {n} trained tokens")
    # Boolean indexing walks row-major: sample by sample, positions in order.
    out[trained] = torch.tensor([x for v in values for x in v], dtype=torch.float32)
    return out


def collate_rl(examples: Sequence[RLExample], *, pad_id: int) -> RLBatch:
    """Tensors for a micro-batch of examples, one per row, right-padded.

    Examples that may share their prompt (`shared_prefix_len`) are run by the model in shared
    rows; every tensor here and the logits `forward_logits` returns stay one sample per row.
    """
    base = prepare_prefix_shared_batch(examples, pad_id=pad_id)
    have_rollout = all(len(e.rollout_logprobs) == e.n_trained for e in examples)
    have_ref = all(e.ref_logprobs is not None for e in examples)

    def per_token(field: str) -> torch.Tensor | None:
        values = [getattr(e, field) for e in examples]
        return _scatter(base, values) if values and None not in values else None

    rewards_GN = None
    if examples and all(e.unit is not None for e in examples) and len(examples) % 2 == 0:
        # The selector's preference (chosen +1, rejected −1), not the rewards: a custom
        # selector may prefer a sample whose reward is not higher (e.g. shorter at equal reward).
        rewards_GN = torch.tensor([e.advantage for e in examples], dtype=torch.float32).view(-1, 2)
    return RLBatch(
        base=base,
        advantages_B=torch.tensor([e.advantage for e in examples], dtype=torch.float32),
        rollout_logprobs_BT=_scatter(base, [e.rollout_logprobs for e in examples])
        if have_rollout
        else None,
        ref_logprobs_BT=_scatter(base, [e.ref_logprobs for e in examples]) if have_ref else None,
        rewards_GN=rewards_GN,
        old_logprobs_BT=per_token("old_logprobs"),
        token_advantages_BT=per_token("token_advantages"),
        returns_BT=per_token("returns"),
        old_values_BT=per_token("old_values"),
    )
