"""A rollout worker as a real subprocess over the local engine (loopback): it generates and
scores the groups it is sent and returns them whole; its failures are named."""

from __future__ import annotations

import os
import signal
from dataclasses import replace

import pytest
import trio

from engines import SGLangEngine
from engines.local import open_local_engine
from engines.stall import stall_bound_s
from engines.testing.fault_proxy import FaultPlan, FaultProxy
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.prompts import PromptItem
from rollouts.workers.frames import decode_groups
from rollouts.workers.process import WorkerLost, WorkerProcess
from rollouts.workers.worker import stats_result

ROLLOUT = RolloutConfig(n_samples_per_prompt=2, sample_retries=0, filter_groups="none",
                        sampling=SamplingConfig(temperature=0.0, max_new_tokens=4))  # fmt: skip
PROMPTS = [PromptItem((11, 12, 13 + i), (), {"answer": str(i)}) for i in range(3)]


def _request(prompts, request=1):
    return {"kind": "collect", "request": request, "rid_prefix": f"t{request}", "overlong": None,
            "prompts": [{"prompt": p.to_dict(), "samples": []} for p in prompts]}  # fmt: skip


async def test_a_worker_process_returns_every_group_scored_as_the_engine_generated_it(
    tiny_model_dir,
):
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            SGLangEngine(server.url, max_retries=0) as engine, trio.open_nursery() as nursery:  # fmt: skip
        # a reward that prints: its output goes to stderr, never into the frames on stdout
        worker = WorkerProcess(0, [server.url], ROLLOUT, "tests.worker_rewards:loud_index_reward",
                               timeout_s=120)  # fmt: skip
        await worker.start(nursery)
        header, buffers = await worker.ask(_request(PROMPTS))
        groups = decode_groups(header["groups"], buffers)
        # the same prompts generated here, greedy: the worker's tokens are the engine's
        expected = [await engine.generate(list(p.prompt_ids), ROLLOUT.sampling.params())
                    for p in PROMPTS]  # fmt: skip
        nursery.cancel_scope.cancel()
    assert header["slots"] == [0, 1, 2] and header["partial"] == []
    assert stats_result(header["stats"]).n_launched == 3
    for prompt, group, want in zip(PROMPTS, groups, expected, strict=True):
        assert [s.index_in_group for s in group] == [0, 1]
        assert [s.reward for s in group] == [0.0, 1.0]  # scored in the worker
        for s in group:
            assert s.prompt_ids == prompt.prompt_ids and s.metadata == {
                "answer": prompt.metadata["answer"]
            }
            assert list(s.response_ids) == list(want.output_ids)
            assert s.rollout_logprobs == pytest.approx(want.output_logprobs, abs=1e-6)


async def test_a_worker_whose_reward_fails_fast_names_the_reward_and_the_worker(tiny_model_dir):
    config = ROLLOUT.model_copy(update={"reward_fail_fast": True})
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            trio.open_nursery() as nursery:  # fmt: skip
        worker = WorkerProcess(3, [server.url], config, "tests.worker_rewards:raising_reward",
                               timeout_s=120)  # fmt: skip
        await worker.start(nursery)
        with pytest.raises(Exception, match=r"rollout worker 3 .*this reward always fails"):
            await worker.ask(_request(PROMPTS[:1]))
        nursery.cancel_scope.cancel()


async def test_a_worker_that_cannot_import_its_reward_says_so(tiny_model_dir):
    async with trio.open_nursery() as nursery:
        worker = WorkerProcess(0, ["http://127.0.0.1:9"], ROLLOUT, "no_such_module:f",
                               timeout_s=60)  # fmt: skip
        with pytest.raises(Exception, match="ended .*before its start answer"):
            await worker.start(nursery)
        nursery.cancel_scope.cancel()


async def test_a_worker_that_gives_no_answer_in_time_is_lost_and_a_restart_replaces_it(
    tiny_model_dir,
):
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            trio.open_nursery() as nursery:  # fmt: skip
        worker = WorkerProcess(0, [server.url], ROLLOUT, "tests.worker_rewards:slow_reward",
                               timeout_s=2)  # fmt: skip
        await worker.start(nursery)
        first = worker.pid
        with pytest.raises(WorkerLost, match=r"gave no groups answer within 2 s "
                                             r"\(rollout.worker_timeout_s\)"):  # fmt: skip
            await worker.ask(_request(PROMPTS[:1]))
        await worker.restart(nursery)  # the hung process is killed, a fresh one answers
        assert worker.pid != first and worker.starts == 2
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("settings", [
    {"generate_timeout_s": 1.0},  # the HTTP limit of a /generate
    {"stall_floor_s": 1.0, "stall_s_per_token": 0.01},  # the pool's stall bound
], ids=["generate_timeout_s", "stall_bound"])  # fmt: skip
async def test_a_worker_gives_up_a_hung_generate_at_the_runs_engine_settings_not_the_defaults(
    tiny_model_dir, settings
):
    """The run's `engines.*` reach a worker's clients and pool (start frame "engines"): its
    engine hangs the first /generate, the worker gives it up at the run's bound and re-sends it,
    long before the library's default bound (60 s + 0.2 s x 4 tokens) would."""
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            trio.open_nursery() as nursery:  # fmt: skip
        proxy = FaultProxy(server.url, FaultPlan(script=("hang",), hang_s=120.0))
        url = await nursery.start(proxy.serve)
        worker = WorkerProcess(0, [url], ROLLOUT, "tests.worker_rewards:loud_index_reward",
                               timeout_s=20, engines=settings)  # fmt: skip
        await worker.start(nursery)
        header, buffers = await worker.ask(_request(PROMPTS[:1]))  # WorkerLost before: 60 s
        nursery.cancel_scope.cancel()
    assert proxy.counts["hang"] == 1
    [group] = decode_groups(header["groups"], buffers)
    assert [s.index_in_group for s in group] == [0, 1]  # the hung sample was sent again
    default_bound_s = stall_bound_s(ROLLOUT.sampling.params(), 60.0, 0.2)
    assert proxy.longest_s["/generate"] < default_bound_s / 4


async def test_a_worker_told_of_pauses_while_it_starts_is_told_nothing_until_ready_and_answers(
    tiny_model_dir,
):
    """The trainer tells its workers of its pauses at any time, also while one is (re)started:
    nothing is sent to the new process until it answered its start frame (a frame before
    it would end it), and it is told once ready."""
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            trio.open_nursery() as nursery:  # fmt: skip
        worker = WorkerProcess(0, [server.url], ROLLOUT, "tests.worker_rewards:index_reward",
                               timeout_s=60)  # fmt: skip
        told: list[bool] = []
        started = trio.Event()

        async def tell_until_started():
            while not started.is_set():  # at every turn of the event loop while it starts
                told.append(await worker.tell({"kind": "paused", "urls": []}))
                await trio.lowlevel.checkpoint()

        async def start():
            await worker.start(nursery)
            started.set()

        async with trio.open_nursery() as starting:
            starting.start_soon(tell_until_started)
            starting.start_soon(start)
        header, _ = await worker.ask(_request(PROMPTS[:1]))
        assert await worker.tell({"kind": "paused", "urls": [server.url]})  # ready: told
        nursery.cancel_scope.cancel()
    assert told and not any(told)
    assert header["slots"] == [0]


async def test_a_group_resumed_from_held_samples_of_another_collection_comes_back_in_its_slot(
    tiny_model_dir,
):
    """A group a push cut short is held with its finished samples, whose group_id is their
    launch number in the collection that made them; sent again (async mode), the group comes
    back in the slot of its prompt in the new request, every sample with one group_id."""
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            trio.open_nursery() as nursery:  # fmt: skip
        worker = WorkerProcess(0, [server.url], ROLLOUT, "tests.worker_rewards:index_reward",
                               timeout_s=60)  # fmt: skip
        await worker.start(nursery)
        header, buffers = await worker.ask(_request(PROMPTS[:1]))
        [[first, _]] = decode_groups(header["groups"], buffers)
        for launch in (1, 5):  # its launch number then: another slot's in the request, and none
            held = replace(first, group_id=launch)
            request = _request(PROMPTS[:2], request=2)
            request["prompts"][0]["samples"] = [held.to_dict()]  # PROMPTS[0], one sample done
            header, buffers = await worker.ask(request)
            groups = decode_groups(header["groups"], buffers)
            assert header["slots"] == [0, 1]
            assert [g[0].prompt_ids for g in groups] == [PROMPTS[0].prompt_ids,
                                                         PROMPTS[1].prompt_ids]  # fmt: skip
            assert [len({s.group_id for s in g}) for g in groups] == [1, 1]
            assert groups[0][0].response_ids == first.response_ids  # the held one, kept
        nursery.cancel_scope.cancel()


async def test_a_workers_view_of_paused_engines_is_the_newest_the_trainer_sent_when_frames_come_together(
    tiny_model_dir,
):
    """A collect frame says no engine is paused (its state taken before a push); the push then
    pauses the engine and the trainer's "paused" frame reaches the worker in the same read (the
    worker was busy; here stopped): the worker's view is the newer state, whatever order it reads
    and applies them in. Its requests wait behind the push three times its stall bound and none
    is taken for stalled (no abort, no rid sent twice); they finish once the push ends."""
    config = ROLLOUT.model_copy(update={"sampling": SamplingConfig(temperature=0.0,
                                                                   max_new_tokens=64)})  # fmt: skip
    stall = {"stall_floor_s": 2.0, "stall_s_per_token": 0.02}  # 3.28 s for 64 tokens
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            SGLangEngine(server.url) as trainer, trio.open_nursery() as nursery:  # fmt: skip
        proxy = FaultProxy(server.url, FaultPlan())
        paths: list[str] = []
        proxy.on_request = paths.append
        url = await nursery.start(proxy.serve)
        worker = WorkerProcess(0, [url], config, "tests.worker_rewards:index_reward",
                               timeout_s=60, engines=stall)  # fmt: skip
        await worker.start(nursery)
        answers: list = []
        request = {**_request(PROMPTS[:2]), "paused": [], "paused_seq": 1}
        os.kill(worker.pid, signal.SIGSTOP)  # it reads nothing until both frames are there
        try:
            async with trio.open_nursery() as asking:
                asking.start_soon(lambda: _append(answers, worker.ask(request)))
                await trainer.pause("retract")  # the push (either frame may be written first:
                # the stopped worker reads both before its collection starts)
                assert await worker.tell({"kind": "paused", "urls": [url], "paused_seq": 2})
                os.kill(worker.pid, signal.SIGCONT)
                await trio.sleep(3 * (2.0 + 0.02 * 64))  # the push's load
                await trainer.resume()
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        nursery.cancel_scope.cancel()
    [(header, buffers)] = answers
    assert "/abort_request" not in paths
    assert len(proxy.rids) == len(set(proxy.rids)) == 4  # none re-sent
    assert stats_result(header["stats"]).n_retried_samples == 0
    assert [len(g) for g in decode_groups(header["groups"], buffers)] == [2, 2]


async def _append(into: list, awaitable) -> None:
    into.append(await awaitable)
