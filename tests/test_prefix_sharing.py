"""Prompt-shared RL rows: the same logprobs, loss and gradients as one row per sample, less compute."""

import random
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from rollouts.errors import ConfigError
from rollouts.types import RolloutBatch, Sample
from training.data.packing import IGNORE_INDEX, forward_logits, token_logprobs
from training.data.prefix_sharing import plan_rows, row_blocks, split_rows_by_budget
from training.rl.algorithms import grpo
from training.rl.batch import RLExample, build_examples, collate_rl, loss_weight_fn, rl_loss_fn

PAD = 0


def rollout_batch(seed: int, *, groups: int = 4, n: int = 4, same_prompt: bool = True
                  ) -> RolloutBatch:  # fmt: skip
    """Random groups; responses end with a tool turn (mask 0) followed by trained tokens."""
    rng = random.Random(seed)

    def ids(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 200) for _ in range(k))

    out = []
    for g in range(groups):
        prompt = ids(rng.randint(6, 14))
        group = []
        for i in range(n):
            head, tool, tail = (
                ids(rng.randint(1, 5)),
                ids(rng.randint(0, 3)),
                ids(rng.randint(1, 4)),
            )
            mask = (1,) * len(head) + (0,) * len(tool) + (1,) * len(tail)
            group.append(Sample(prompt if same_prompt else ids(rng.randint(6, 14)),
                                head + tool + tail, mask, tuple(-1.0 * m for m in mask),
                                reward=float(rng.random() < 0.5), group_id=g, index_in_group=i))  # fmt: skip
        out.append(tuple(group))
    return RolloutBatch(tuple(out), 1, 0)


def unshared(examples):
    return [replace(e, shared_prefix_len=0) for e in examples]


def test_a_group_shares_one_row_and_a_group_with_differing_prompts_falls_back():
    shared = rollout_batch(0, groups=1).groups
    differing = rollout_batch(1, groups=1, same_prompt=False).groups
    examples = build_examples(RolloutBatch(shared + differing, 1, 0), grpo())
    rows = plan_rows(examples)
    assert [(r.start, r.stop) for r in rows] == [(0, 4), (4, 5), (5, 6), (6, 7), (7, 8)]
    assert rows[0].prefix_len == len(shared[0][0].prompt_ids)
    batch, plain = collate_rl(examples, pad_id=PAD), collate_rl(unshared(examples), pad_id=PAD)
    # five short trees: cheapest side by side in one model row
    assert batch.input_ids.shape[0] == 1 and batch.attention_mask is not None
    assert batch.n_tokens < plain.n_tokens
    # everything after the model is in the per-sample view, unchanged
    assert torch.equal(batch.target_ids, plain.target_ids)
    assert torch.equal(batch.segment_ids, plain.segment_ids)
    assert torch.equal(batch.rollout_logprobs_BT, plain.rollout_logprobs_BT)
    alone = collate_rl(build_examples(RolloutBatch(differing, 1, 0), grpo()), pad_id=PAD)
    assert alone.attention_mask is None and alone.source_index is None  # the plain batch
    off = build_examples(RolloutBatch(shared, 1, 0), grpo(), share_prompts=False)
    assert collate_rl(off, pad_id=PAD).attention_mask is None


def test_a_branch_sees_the_prompt_and_itself_at_continued_positions():
    examples = [RLExample((5, 6, 7, 8), (0, 0, 1, 1), 1.0, (), shared_prefix_len=2),
                RLExample((5, 6, 9), (0, 0, 1), -1.0, (), shared_prefix_len=2)]  # fmt: skip
    batch = collate_rl(examples, pad_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    assert batch.attention_mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # token 9: the prompt and itself, not the other branch
    ]
    # sample 1's position 1 (token 6, predicting 9) is the shared prompt position 1
    assert batch.source_index[:, :3].tolist() == [[0, 1, 2], [0, 1, 4]]
    assert batch.target_ids.tolist() == [[IGNORE_INDEX, 7, 8, IGNORE_INDEX],
                                         [IGNORE_INDEX, 9, IGNORE_INDEX, IGNORE_INDEX]]  # fmt: skip


def test_trees_side_by_side_in_a_row_never_see_each_other():
    examples = [RLExample((5, 6, 7), (0, 0, 1), 1.0, (), shared_prefix_len=2),
                RLExample((5, 6, 8), (0, 0, 1), -1.0, (), shared_prefix_len=2),
                RLExample((9, 7), (0, 1), 1.0, (), shared_prefix_len=1),
                RLExample((9, 8), (0, 1), -1.0, (), shared_prefix_len=1)]  # fmt: skip
    batch = collate_rl(examples, pad_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 7, 8]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 2, 0, 1, 1]]
    assert batch.attention_mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0],  # the second tree's prompt: nothing of the first tree
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1, 0, 1],
    ]
    assert batch.source_index[:, :2].tolist() == [[0, 1], [0, 1], [4, 5], [4, 6]]


def test_trees_are_packed_only_when_that_is_cheaper():
    from training.data.prefix_sharing import pack_trees

    assert pack_trees([40, 10, 10, 20]) == [[0], [1, 2, 3]]  # 2 rows of 40: no padding
    assert pack_trees([30]) == [[0]]
    # wide trees: attention over a combined row costs more than the padding it saves
    assert pack_trees([3000, 2000], pairs_per_token=512) == [[0], [1]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_rows_give_the_logprobs_loss_and_gradients_of_one_row_per_sample(
    tiny_model_dir, attn
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn)
    examples = build_examples(rollout_batch(2), grpo())
    assert collate_rl(examples, pad_id=PAD).input_ids.shape[0] < len(plan_rows(examples))  # packed
    loss_fn = rl_loss_fn(grpo())
    out = {}
    for name, exs in (("shared", examples), ("plain", unshared(examples))):
        batch = collate_rl(exs, pad_id=PAD)
        model.zero_grad(set_to_none=True)
        logits = forward_logits(model, batch)
        loss, _ = loss_fn(logits, batch)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        out[name] = token_logprobs(logits, batch.target_ids).detach(), loss.item(), grads
    (lp, loss, grads), (lp0, loss0, grads0) = out["shared"], out["plain"]
    assert (lp - lp0).abs().max().item() < 1e-5
    assert abs(loss - loss0) < 1e-5
    for k, g0 in grads0.items():
        assert (grads[k] - g0).abs().max() <= 1e-4 * g0.abs().max() + 1e-9, k


async def test_backend_update_and_logprobs_match_the_unshared_path(tiny_model_dir, tmp_path):
    from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
    from training.config import OptimConfig

    examples = build_examples(rollout_batch(3, groups=6), grpo())
    results = {}
    for name, exs in (("shared", examples), ("plain", unshared(examples))):
        model, tok = load_model_and_tokenizer(tiny_model_dir)
        with PyTorchTrainingBackend(
            model, tok, optim=OptimConfig(), max_steps=1, checkpoint_dir=tmp_path / name,
            pack_length=None, micro_batch_tokens=120,  # several micro-batches
            collate_fn=partial(collate_rl, pad_id=tok.pad_token_id),
        ) as backend:  # fmt: skip
            logprobs = await backend.compute_logprobs(exs).result()
            metrics = await backend.forward_backward(
                exs, loss_fn=rl_loss_fn(grpo()), loss_weight_fn=loss_weight_fn(grpo())
            ).result()
            grads = torch.cat([p.grad.flatten() for p in backend.model.parameters()])
        results[name] = logprobs, metrics, grads
    (lp, m, g), (lp0, m0, g0) = results["shared"], results["plain"]
    assert m["n_microbatches"] > 1 and m["n_tokens"] < 0.7 * m0["n_tokens"]
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(lp, lp0, strict=True))
    assert m["loss"] == pytest.approx(m0["loss"], abs=1e-5)
    assert (g - g0).abs().max() <= 1e-4 * g0.abs().max()


class LogitsOnly(torch.nn.Module):
    """A 'model' whose logits are a parameter: shows which model positions get a gradient."""

    def __init__(self, rows: int, width: int, attn: str = "sdpa"):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(rows, width, 16))
        self.config = SimpleNamespace(_attn_implementation=attn)

    def forward(self, input_ids, position_ids, attention_mask, use_cache):
        assert attention_mask.shape == (*input_ids.shape[:1], 1, *input_ids.shape[1:2] * 2)
        return SimpleNamespace(logits=self.logits)


def test_tool_tokens_in_a_shared_row_get_no_gradient():
    # prompt 5 6; branch a: 7 (trained) 8 (tool) 9 (trained); branch b: 10 (trained)
    examples = [RLExample((5, 6, 7, 8, 9), (0, 0, 1, 0, 1), 1.0, (), shared_prefix_len=2),
                RLExample((5, 6, 10), (0, 0, 1), -1.0, (), shared_prefix_len=2)]  # fmt: skip
    batch = collate_rl(examples, pad_id=PAD)
    model = LogitsOnly(*batch.input_ids.shape)
    loss, _ = rl_loss_fn(grpo())(forward_logits(model, batch), batch)
    loss.backward()
    got = model.logits.grad[0].abs().sum(-1) > 0  # per row position: [5, 6, 7, 8, 9, 10]
    # 6 predicts 7 and 10, 8 predicts 9; 7 predicts the tool token 8: no gradient
    assert got.tolist() == [False, True, False, True, False, False]


def test_attention_without_custom_masks_is_refused():
    examples = build_examples(rollout_batch(4, groups=1), grpo())
    batch = collate_rl(examples, pad_id=PAD)
    model = LogitsOnly(*batch.input_ids.shape, attn="flash_attention_2")
    with pytest.raises(ConfigError, match="share_prompts=False"):
        forward_logits(model, batch)


def test_long_responses_get_rows_of_their_own_and_short_ones_share():
    def group(response_len: int) -> list[RLExample]:
        ids = (1,) * 16 + (2,) * response_len
        return [RLExample(ids, (0,) * 16 + (1,) * response_len, 0.0, (), shared_prefix_len=16)] * 8

    assert len(plan_rows(group(8))) == 1
    assert len(plan_rows(group(4000))) == 8  # W² attention would cost more than 7 prompts


def test_micro_batches_hold_whole_rows_and_pairs_within_the_budget():
    examples = build_examples(rollout_batch(5, groups=6), grpo())
    examples += unshared(examples[:6])
    examples += [replace(e, unit=99) for e in unshared(examples[:2])]  # a pair: never split
    for budget in (1, 60, 150, 10_000):
        mbs = split_rows_by_budget(examples, budget)
        assert [e for mb in mbs for e in mb] == examples
        for mb in mbs:
            rows = plan_rows(mb)
            slots = len(rows) * max(r.width for r in rows)
            assert slots <= budget or len(mbs) == 1 or len(rows) == 1 or mb[-1].unit == 99
        assert any(mb[-2:] == examples[-2:] for mb in mbs)
    assert len(split_rows_by_budget(examples, 10_000)) == 1


def fill_to_the_budget(samples, budget):
    """The split `split_rows_by_budget` replaces: each micro-batch filled with whole blocks
    while they fit, so the last one may hold a single row."""
    out, begin, n_rows, widest = [], 0, 0, 0
    for start, widths in row_blocks(samples):
        wide = max(widest, *widths)
        if n_rows and (n_rows + len(widths)) * wide > budget:
            out.append(samples[begin:start])
            begin, n_rows, wide = start, 0, max(widths)
        n_rows, widest = n_rows + len(widths), wide
    return out + ([samples[begin:]] if begin < len(samples) else [])


@pytest.mark.parametrize("seed", range(60))
def test_micro_batches_are_as_few_as_filling_each_and_no_larger_within_the_budget(seed):
    """Any mix of shared groups, rows of their own and pairs, at any budget: the samples in
    order, each micro-batch within the budget (or one row or pair that alone exceeds it), as
    many micro-batches as filling each to the budget, and the largest no larger in tokens."""
    rng = random.Random(seed)
    batch = rollout_batch(seed, groups=rng.randint(1, 8), n=rng.randint(2, 6),
                          same_prompt=rng.random() < 0.7)  # fmt: skip
    examples = build_examples(batch, grpo())
    if rng.random() < 0.3:
        examples = unshared(examples)
    if rng.random() < 0.5:  # a pair: one block of two rows
        at = rng.randint(0, len(examples))
        pair = [replace(e, unit=99) for e in unshared(examples[:2])]
        examples = examples[:at] + pair + examples[at:]
    budget = rng.choice([1, rng.randint(10, 60), rng.randint(60, 400), 10_000])
    mbs, greedy = split_rows_by_budget(examples, budget), fill_to_the_budget(examples, budget)

    def tokens(mb):
        return sum(row.width for row in plan_rows(mb))

    assert [e for mb in mbs for e in mb] == examples
    for mb in mbs:
        rows = plan_rows(mb)
        assert len(rows) * max(r.width for r in rows) <= budget or len(row_blocks(mb)) == 1
    assert len(mbs) == len(greedy)
    assert max(map(tokens, mbs)) <= max(map(tokens, greedy))


def test_equal_rows_are_split_into_equal_micro_batches():
    """16 rows at a budget of 15 are 8 + 8, not 15 + 1 (a pass of per-micro-batch kernel
    launches, and a shape of its own to compile, for one row); any count differs by <= 1."""
    example = RLExample((5,) * 12, (0,) * 6 + (1,) * 6, 1.0, ())
    assert [len(mb) for mb in split_rows_by_budget([example] * 16, 15 * 12)] == [8, 8]
    for n in range(1, 40):
        for per in range(1, 12):
            sizes = [len(mb) for mb in split_rows_by_budget([example] * n, per * 12)]
            assert len(sizes) == -(-n // per) and max(sizes) - min(sizes) <= 1, (n, per, sizes)
