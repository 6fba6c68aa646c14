"""The `GenerateFn` extension point: its context, and the default, one assistant turn.

Why a module of its own: a `GenerateFn` produces the n samples of one prompt and is what a user
replaces (`rollouts.multiturn`, `rollouts.envs`); `generation.collect_groups` drives many of them
under a global concurrency limit, and that loop is the other module's concern.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from rollouts.prompts import PromptItem
from rollouts.request_ids import oldest_version, request_rid
from rollouts.types import Sample


class GenerateEngine(Protocol):
    """The part of an engine/EnginePool that rollouts use."""

    async def generate(self, input_ids, sampling_params=None, *, rid=None, return_logprob=True,
                       top_logprobs_num=0, logprob_start_len=None): ...  # fmt: skip

    async def abort(self, rid: str) -> None: ...


@dataclass(frozen=True)
class GenerateContext:
    """What a generate function gets besides the prompt: where and how to sample."""

    engine: GenerateEngine
    sampling_params: Mapping[str, Any]
    limiter: trio.CapacityLimiter
    rid_prefix: str
    group_id: int
    tokenizer: Any = None
    in_flight: set[str] = field(default_factory=set)  # rids currently at the engine
    report: Callable[[Sample], None] = lambda sample: None  # early scoring; see GenerateFn
    slot_lock: trio.Lock = field(default_factory=trio.Lock)  # shared by all groups; hold_slots


GenerateFn = Callable[[PromptItem, int, GenerateContext], Awaitable[list[Sample]]]
"""(prompt, n, ctx) -> n samples with distinct `index_in_group` (`sub_index` 0), and any extra
samples of the same rollouts (`sub_index` 1, 2, ...: an agent session's other branches; they
train as samples of the group but a group is complete with its n). It may call `ctx.report(s)`
as each sample finishes, so its reward is computed at once and the sample survives if the group
is cut short; samples it returns without reporting are scored after it returns. Samples
reported with no await in between are scored as one batch (`rollouts.scoring`)."""


_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}


def _sample_from(prompt: PromptItem, r: Any, i: int, ctx: GenerateContext) -> Sample:
    return Sample(
        prompt_ids=prompt.prompt_ids,
        response_ids=r.output_ids,
        loss_mask=(1,) * len(r.output_ids),
        rollout_logprobs=r.output_logprobs or (),
        response_text=r.text,
        status=_STATUS.get(r.finish_reason.type, "completed"),
        group_id=ctx.group_id,
        index_in_group=i,
        weight_version=oldest_version(r),
        metadata=prompt.metadata,
        finish_reason=r.finish_reason.type,
    )


@asynccontextmanager
async def hold_slots(limiter: trio.CapacityLimiter, k: int, lock: trio.Lock
                     ) -> AsyncIterator[None]:  # fmt: skip
    """Hold `k` tokens of `limiter` at once (one batched request counts as k requests).

    Takers of several tokens queue on `lock` (shared by all of them) so that two half-served
    takers can never wait on each other forever.
    """
    borrowers = [object() for _ in range(k)]
    held: list[object] = []
    try:
        async with lock:  # a checkpoint: the free tokens below are taken without one
            for borrower in borrowers:
                try:
                    limiter.acquire_on_behalf_of_nowait(borrower)  # fails while others queue
                except trio.WouldBlock:
                    await limiter.acquire_on_behalf_of(borrower)
                held.append(borrower)
        yield
    finally:
        for borrower in held:
            limiter.release_on_behalf_of(borrower)


async def single_turn_generate(prompt: PromptItem, n: int, ctx: GenerateContext) -> list[Sample]:
    """The default GenerateFn: `n` independent samples of one assistant turn, token in/out.

    On an engine with `generate_batch` (SGLangEngine, EnginePool) the group goes out as one
    batched `/generate` call with a rid per sample (aborts still work per sample), chunked to the
    concurrency limit; this is several times faster than one HTTP request per sample.
    """
    out: list[Sample | None] = [None] * n
    batch = getattr(ctx.engine, "generate_batch", None)

    async def chunk(start: int, stop: int) -> None:
        rids = [request_rid(ctx.rid_prefix, i) for i in range(start, stop)]
        async with hold_slots(ctx.limiter, len(rids), ctx.slot_lock):
            ctx.in_flight.update(rids)
            try:
                if batch is not None:
                    results = await batch([prompt.prompt_ids] * len(rids), ctx.sampling_params,
                                          rids=rids)  # fmt: skip
                else:
                    results = [await ctx.engine.generate(prompt.prompt_ids, ctx.sampling_params,
                                                         rid=rids[0])]  # fmt: skip
            finally:
                ctx.in_flight.difference_update(rids)
        for i, r in zip(range(start, stop), results, strict=True):
            out[i] = _sample_from(prompt, r, i, ctx)
            ctx.report(out[i])

    size = max(1, int(ctx.limiter.total_tokens)) if batch is not None else 1
    starts = range(0, n, size)
    if len(starts) == 1:  # the common case: one request, no nursery needed
        await chunk(0, n)
    else:
        async with trio.open_nursery() as nursery:
            for start in starts:
                nursery.start_soon(chunk, start, min(n, start + size))
    return [s for s in out if s is not None]
