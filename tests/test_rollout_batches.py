"""generate_rollout_batches against the real local engine: n batches then the end, and a break
that stops generation with no task left running and no request left at the engine."""

from __future__ import annotations

import trio

from rollouts import generate_rollout_batches
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import prompt_item
from training.data.buffer import DataBuffer


def make_manager(engine, tokenizer, mode: str, max_new_tokens: int = 4) -> AsyncRolloutManager:
    prompts = [prompt_item(tokenizer, [{"role": "user", "content": f"{i}+{i}"}],
                           {"answer": str(2 * i)}) for i in range(40)]  # fmt: skip
    cfg = RolloutConfig(sampling=SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens),
                        batch_size=2, n_samples_per_prompt=2, mode=mode)  # fmt: skip
    return AsyncRolloutManager(engine, DataBuffer(prompts, seed=0), cfg, reward_fn=lambda s: 0.0)


def live_tasks() -> list[str]:
    """Names of every task in the run, less the engine's per-connection handlers (the server
    side of the client's keep-alive connections, which live as long as the connection)."""

    def walk(task: trio.lowlevel.Task) -> list[str]:
        return [task.name] + [
            x for n in task.child_nurseries for t in n.child_tasks for x in walk(t)
        ]

    names = walk(trio.lowlevel.current_root_task())
    return sorted(n for n in names if n != "trio._highlevel_serve_listeners._run_handler")


async def test_yields_exactly_n_batches_of_the_configured_shape(local_engine, tiny_tokenizer):
    _, engine = local_engine
    manager = make_manager(engine, tiny_tokenizer, "sync")
    with trio.fail_after(60):
        async with generate_rollout_batches(manager, 3) as batches:
            got = [batch async for batch in batches]
    assert len(got) == 3
    assert all(len(b.groups) == 2 and all(len(g) == 2 for g in b.groups) for b in got)
    assert manager.statistics().batches_served == 3  # none generated beyond what was asked


async def test_break_stops_generation_and_leaves_no_task_or_request(local_engine, tiny_tokenizer):
    server, engine = local_engine
    for mode in ("sync", "overlap", "async"):  # overlap/async: a batch is in flight at the break
        before = live_tasks()
        manager = make_manager(engine, tiny_tokenizer, mode, max_new_tokens=64)
        with trio.fail_after(60):
            async with generate_rollout_batches(manager) as batches:
                async for batch in batches:
                    assert batch.groups
                    while mode != "sync" and not server.state.scheduler.running:
                        await trio.sleep(0.01)  # the next batch is being generated: break now
                    break
            assert live_tasks() == before, mode
            # The cut-off batch's requests ended on the way out (cancelled requests, and the
            # manager's abort_all), not left to finish 64-token generations nobody will read.
            scheduler = server.state.scheduler
            left = [q for q in (*scheduler.running, *scheduler.waiting) if not q.finished]
            assert not left, (mode, [q.item.rid for q in left])
        assert manager._nursery is None
