"""Prefix sharing: score the responses to one prompt against ONE copy of it (pure functions).

GRPO samples n responses per prompt; one row per sample runs the prompt through the model n
times. Here consecutive examples whose first `shared_prefix_len` tokens are identical share a
row: the prompt once, then each response as a branch.

    tokens:     p0 p1 p2 | a0 a1 | b0 b1 b2 | pad
    positions:   0  1  2 |  3  4 |  3  4  5 |
    a branch attends to the prompt and, causally, to itself; never to another branch.

Positions continue from the prompt length in every branch, so each response token sees the
same keys, values and RoPE positions as in its own row, and gets the same logits up to float
summation order (~1e-6). Only the model input changes: the batch keeps the per-sample view of
`prepare_sft_batch(packing=False)` (`target_ids`, `segment_ids`: one sample per row) plus
`source_index`, the flat position in the shared rows of each per-sample position, and
`forward_logits` gathers the logits into that view. Losses, logprob gathering and reference /
old logprobs are therefore unchanged; gradients flow back through the gather (a prompt position
used by k samples accumulates their k contributions, as k separate rows would).

Several rows (trees) may then share one model row, side by side, each attending only within
itself (`pack_trees`): groups' rows differ in width, and padding every row to the widest wasted
~20 % of the slots of a GRPO step on the tiny model. The layout with the lowest estimated cost
(slots plus attention pairs, as below) is chosen.

What it costs: a row of W tokens needs a [W, W] mask and attention over all W² pairs (a tree
mask rules out the causal fast path), against Σ(P+L)² for separate rows, while sharing saves
(k−1)·P tokens of every per-token op (projections, MLP, lm_head). Rows are built greedily: a
response joins the current row while that is cheaper than a new row with its own copy of the
prompt, counting one token of per-token work as `ATTENTION_PAIRS_PER_TOKEN` query-key pairs.
Short RL responses (the regime of GRPO on small prompts) put a whole group in one row; long
ones (L ≫ P) get a few branches per row, or one row per sample.

Which examples share: consecutive examples with the same `unit` (None included) whose
`shared_prefix_len` P is the same, > 0 and shorter than the example, and whose first P tokens
are identical. Anything else gets a row of its own (multi-turn samples whose prompts differ,
`shared_prefix_len == 0` when sharing is switched off). A micro-batch of one-example rows is the
plain per-sample batch, with no mask, exactly as without this module.

The model must accept a 4D attention mask: transformers' sdpa and eager attention do (checked
in `training.data.packing.forward_logits`); flash-attention kernels do not.

Pure: imports torch only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from training.data.packing import SFTBatch, pack_balanced, prepare_sft_batch

# How many query-key pairs of attention cost as much as one token's per-token work. FLOP
# counting says ~6 x hidden_size (~1150 for the tiny model, ~5000 for 0.5B models). Measured on
# the tiny model (1 thread, 4 groups x 8 samples, responses up to 64-384 tokens), 1024-4096 all
# beat one row per sample and 2048 was the most even; larger values put long responses in
# rows so wide that attention costs more than the prompt copies saved.
ATTENTION_PAIRS_PER_TOKEN = 2048
# Model-row counts `pack_trees` tries: 1, 2, 3, 4, 6, 8, 12, ... (geometric, so few tries).
_ROW_COUNTS = sorted({c for k in range(12) for c in (2**k, 3 * 2**k)})


@dataclass(frozen=True)
class Row:
    """Examples `start:stop` (consecutive) in one model row, sharing `prefix_len` tokens."""

    start: int
    stop: int
    prefix_len: int  # 0 for a row of one example: the whole example is its one branch
    width: int  # tokens in the row


def shared_prefix_key(example: Any) -> tuple[Any, tuple[int, ...]] | None:
    """(unit, prompt tokens) for an example that may share its prompt; None if it may not.

    Examples without a `shared_prefix_len` attribute (SFT samples) never share.
    """
    n = getattr(example, "shared_prefix_len", 0)
    if not 0 < n < len(example.input_ids):
        return None
    return getattr(example, "unit", None), tuple(example.input_ids[:n])


def plan_rows(examples: Sequence[Any], *, pairs_per_token: int = ATTENTION_PAIRS_PER_TOKEN
              ) -> list[Row]:  # fmt: skip
    """Rows covering `examples` in order; see the module docstring for who shares.

    Deterministic, and the same on any slice that starts and ends at row boundaries (the greedy
    choice restarts at each row), so micro-batches cut at row boundaries re-plan identically.
    """
    rows: list[Row] = []
    i = 0
    while i < len(examples):
        key = shared_prefix_key(examples[i])
        j = i + 1
        while key is not None and j < len(examples) and shared_prefix_key(examples[j]) == key:
            j += 1
        if j - i == 1:
            rows.append(Row(i, j, 0, len(examples[i].input_ids)))
        else:
            rows += _split_run(examples, i, j, len(key[1]), pairs_per_token)
        i = j
    return rows


def _split_run(examples: Sequence[Any], i: int, j: int, prefix: int, k: int) -> list[Row]:
    """Rows for examples i..j-1 that share `prefix` tokens: greedy, cheapest next step."""
    rows: list[Row] = []
    start, width = i, len(examples[i].input_ids)
    for s in range(i + 1, j):
        branch = len(examples[s].input_ids) - prefix
        append = branch + ((width + branch) ** 2 - width**2) / k
        fresh = prefix + branch + (prefix + branch) ** 2 / k
        if append <= fresh:
            width += branch
            continue
        rows.append(Row(start, s, prefix if s - start > 1 else 0, width))
        start, width = s, prefix + branch
    rows.append(Row(start, j, prefix if j - start > 1 else 0, width))
    return rows


def row_blocks(samples: Sequence[Any]) -> list[tuple[int, list[int]]]:
    """The samples as blocks that must stay together: (first sample, widths of its rows).

    A block is one planned row (a run of samples sharing a prompt, or one sample), or the rows
    of samples with the same non-None `unit` (a DPO pair). Blocks are consecutive.
    """
    blocks: list[tuple[int, list[int]]] = []
    for row in plan_rows(samples):
        unit = getattr(samples[row.start], "unit", None)
        joins = (
            blocks and unit is not None and getattr(samples[row.start - 1], "unit", None) == unit
        )
        if joins:
            start, widths = blocks.pop()
            blocks.append((start, [*widths, row.width]))
        else:
            blocks.append((row.start, [row.width]))
    return blocks


def split_rows_by_budget(samples: Sequence[Any], max_slots: int) -> list[list[Any]]:
    """Consecutive micro-batches of whole rows, each at most `max_slots` padded slots, as few
    as fit and about equally many tokens each.

    A micro-batch of R rows padded to the widest costs R × width slots. Samples with the same
    non-None `unit` (a DPO pair) stay in one micro-batch; a row or unit wider than the budget
    gets a micro-batch of its own. Filling each micro-batch to the budget would leave a short
    last one (16 rows at a budget of 15: 15 + 1, a whole pass of per-micro-batch kernel
    launches, and a shape of its own to compile, for one row); the same count cut evenly is
    8 + 8. The loss normaliser is the op's, so the cut changes no gradient.
    """
    blocks = row_blocks(samples)
    cuts = balanced_cuts([len(w) for _, w in blocks], [max(w) for _, w in blocks],
                         [sum(w) for _, w in blocks], max_slots)  # fmt: skip
    starts = [start for start, _ in blocks] + [len(samples)]
    return [list(samples[starts[a] : starts[b]]) for a, b in itertools.pairwise(cuts)]


def balanced_cuts(rows: Sequence[int], widths: Sequence[int], tokens: Sequence[int],
                  max_slots: int) -> list[int]:  # fmt: skip
    """Cut points 0 = c0 < c1 < ... = n of consecutive blocks (block i: `rows[i]` rows, the
    widest `widths[i]`, `tokens[i]` tokens) into the fewest parts within `max_slots` (a part
    of one block may exceed it), with about equal tokens.

    Of the cuts into that many parts: those whose largest part has the fewest tokens, and
    among them, left to right, each part ending where its tokens are nearest an equal share
    of the tokens left. The fewest parts blocks i.. need is the number of parts of the greedy
    cut from the right that they meet (greedy is optimal for costs that grow with the range).
    """
    n = len(rows)

    def needs(cap: float) -> list[int]:  # the fewest parts of blocks i.. (and of none: 0)
        out, b = [0] * (n + 1), n
        while b > 0:  # the greedy part ending at b: as far left as the budget and cap allow
            a, n_rows, widest, taken = b - 1, rows[b - 1], widths[b - 1], tokens[b - 1]
            while a > 0:
                n_rows, widest = n_rows + rows[a - 1], max(widest, widths[a - 1])
                taken += tokens[a - 1]
                if n_rows * widest > max_slots or taken > cap:
                    break
                a -= 1
            out[a:b] = [out[b] + 1] * (b - a)
            b = a
        return out

    total = sum(tokens)
    greedy = needs(total)
    k = greedy[0]
    # the smallest cap that keeps k parts: at least the largest block and an equal share, at
    # most the largest part of the greedy cut
    lo = max([*tokens, -(-total // max(k, 1))])
    hi = max([lo] + [sum(tokens[a:b]) for a, b in itertools.pairwise(_starts(greedy))])
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if needs(mid)[0] <= k else (mid + 1, hi)
    fewest = needs(lo)
    cuts, left = [0], total
    for parts in range(k, 0, -1):
        a, best = cuts[-1], None
        n_rows = widest = taken = 0
        for b in range(a + 1, n + 1):  # the ends of the parts from a within budget and cap
            n_rows, widest = n_rows + rows[b - 1], max(widest, widths[b - 1])
            taken += tokens[b - 1]
            if b > a + 1 and (n_rows * widest > max_slots or taken > lo):
                break
            off = abs(taken - left / parts)
            if fewest[b] < parts and (best is None or off < best[0]):
                best = (off, b, taken)
        assert best is not None  # the greedy part from `a` ends where `fewest` drops by one
        cuts.append(best[1])
        left -= best[2]
    return cuts


def _starts(needs: Sequence[int]) -> list[int]:
    """Where the parts of a greedy cut from the right begin (with the end), from its `needs`."""
    return [i for i in range(len(needs)) if i == 0 or needs[i] != needs[i - 1]]


def pack_trees(widths: Sequence[int], *, pairs_per_token: int = ATTENTION_PAIRS_PER_TOKEN
               ) -> list[list[int]]:  # fmt: skip
    """Trees (planned rows) of `widths` grouped into model rows: the cheapest balanced layout.

    A layout of R rows padded to width W costs R·W slots of per-token work plus R·W² attention
    pairs (/ `pairs_per_token`). One tree per row is the baseline; packing into fewer, equally
    long rows (`pack_balanced`) is tried for row counts 1, 2, 3, 4, 6, 8, 12, ... (a dozen tries
    even for hundreds of trees). Deterministic.
    """

    def cost(layout: list[list[int]]) -> float:
        width = max(sum(widths[i] for i in row) for row in layout)
        return len(layout) * (width + width * width / pairs_per_token)

    best = [[i] for i in range(len(widths))]
    best_cost = cost(best)
    total, widest = sum(widths), max(widths, default=0)
    for n in (c for c in _ROW_COUNTS if c < len(widths)):
        layout = pack_balanced([range(w) for w in widths], max(widest, -(-total // n)))
        if (c := cost(layout)) < best_cost:
            best, best_cost = layout, c
    return best


def prepare_prefix_shared_batch(examples: Sequence[Any], *, pad_id: int) -> SFTBatch:
    """The batch for `examples` with shared prompts; the per-sample batch when none share.

    Args:
        examples: RL examples (`input_ids`, `loss_mask`, `shared_prefix_len`, `unit`).
        pad_id: token id for padding slots.

    Returns:
        An `SFTBatch` whose `target_ids` / `segment_ids` are those of
        `prepare_sft_batch(examples, packing=False)`; when some row holds several examples its
        `input_ids` / `position_ids` are the shared rows [R, W], with `attention_mask`
        [R, 1, W, W] (bool, True = may attend) and `source_index` [B, T].
    """
    base = prepare_sft_batch(examples, pad_id=pad_id, packing=False)
    rows = plan_rows(examples)
    if all(row.stop - row.start == 1 for row in rows):
        return base
    layout = pack_trees([row.width for row in rows])
    width = max(sum(rows[t].width for t in trees) for trees in layout)
    shape = (len(layout), width)
    # Per slot: its tree and its branch (ids unique within a model row; a tree's prompt is a
    # branch every branch of that tree sees). Pads are trees of their own (they see themselves).
    # Flat Python lists, converted once (per-sample tensor ops cost more for short responses).
    ids_: list[int] = []
    positions: list[int] = []
    tree_of: list[int] = []
    branch_of: list[int] = []
    prompt_flags: list[bool] = []
    sources: list[list[int]] = [[] for _ in examples]
    for r, trees in enumerate(layout):
        flat, next_branch = r * width, 0
        for t in trees:
            row, start = rows[t], len(ids_) - flat
            p = row.prefix_len
            ids_.extend(examples[row.start].input_ids[:p])
            positions.extend(range(p))
            branch_of.extend([next_branch] * p)
            prompt_flags.extend([True] * p)
            prompt_slots = list(range(flat + start, flat + start + p))
            for s in range(row.start, row.stop):
                next_branch += 1
                ids = examples[s].input_ids
                n, offset = len(ids) - p, len(ids_) - flat
                ids_.extend(ids[p:])
                positions.extend(range(p, p + n))
                branch_of.extend([next_branch] * n)
                prompt_flags.extend([False] * n)
                sources[s] = prompt_slots + list(range(flat + offset, flat + offset + n))
            tree_of.extend([t] * (len(ids_) - flat - start))
            next_branch += 1
        used = len(ids_) - flat
        pads = [-1 - c for c in range(used, width)]
        ids_.extend([pad_id] * len(pads))
        positions.extend(range(len(pads)))
        tree_of.extend(pads)
        branch_of.extend(pads)
        prompt_flags.extend([False] * len(pads))
    input_ids = torch.tensor(ids_, dtype=torch.long).view(shape)
    position_ids = torch.tensor(positions, dtype=torch.long).view(shape)
    tree_ids = torch.tensor(tree_of, dtype=torch.long).view(shape)
    branch_ids = torch.tensor(branch_of, dtype=torch.long).view(shape)
    is_prompt = torch.tensor(prompt_flags, dtype=torch.bool).view(shape)
    n_cols = base.target_ids.shape[1]
    source_index = torch.tensor([src + [0] * (n_cols - len(src)) for src in sources],
                                dtype=torch.long)  # fmt: skip
    same_tree = tree_ids[:, None, :] == tree_ids[:, :, None]
    causal = position_ids[:, None, :] <= position_ids[:, :, None]
    sees = (branch_ids[:, None, :] == branch_ids[:, :, None]) | is_prompt[:, None, :]
    return replace(
        base,
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=(same_tree & causal & sees).unsqueeze(1),
        source_index=source_index,
        n_tokens=sum(row.width for row in rows),
        n_slots=shape[0] * shape[1],
    )
