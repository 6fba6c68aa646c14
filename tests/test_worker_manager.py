"""WorkerRolloutManager: an RL run over K rollout worker processes trains every prompt once, as
the in-process manager does (equal losses when sampling is greedy), and a worker SIGKILLed
mid-batch is restarted with its groups generated again: 0 lost, 0 trained twice. In sync and
overlap mode (greedy) the losses equal K=0's; in async mode every checkpoint holds exactly the
prompts drawn and not trained, and groups an engine pause cut short in a worker are held."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter
from pathlib import Path

import pytest
import trio

from engines import SGLangEngine
from engines.local import open_local_engine
from engines.testing.fault_proxy import FaultPlan, FaultProxy
from plumbing.errors import RolloutsError
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import PromptItem
from rollouts.workers.manager import WorkerRolloutManager
from tests.rl_helpers import prompts
from tests.test_rollout_manager import HoldsRecorded
from tests.worker_rewards import answer_reward
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.data.buffer import DataBuffer
from training.loops.hooks import RLHooks
from training.loops.rl import run_rl_training
from training.rl.algorithms import reinforce
from training.rl.batch import collate_rl
from training.rl.dump_audit import ROLLOUT_MODE_LAG, audit_rollout_dump, read_dump_lines
from training.rl.objective import RLObjective
from training.rl.rollout_dump import RolloutDumpWriter, read_rollout_dump
from training.rl_config import RLLoopConfig

STEPS = 3
ROLLOUT = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                        sampling=SamplingConfig(temperature=0.0, max_new_tokens=6))  # fmt: skip
REWARD = "tests.worker_rewards:answer_reward"
N_PROMPTS = 16  # more than an async run draws: no prompt comes round twice


async def _run(model_dir: Path, out: Path, url: str, workers: int, during=None, *,
               mode: str = "sync", checkpoint_every: int = 10, resume: bool = False,
               states: dict | None = None) -> tuple:  # fmt: skip
    """`run_rl_training` for STEPS steps over the engine at `url` in `mode`, generation in this
    process (workers=0) or in `workers` processes; (history, the dump's path, the prompts
    drawn, the manager). `states` gets each checkpoint's DataBuffer state by step; `resume`
    resumes from the latest checkpoint in `out`."""
    model, tok = load_model_and_tokenizer(model_dir)
    buffer = DataBuffer(prompts(tok, N_PROMPTS), seed=0)
    drawn = [
        p.prompt_ids for p in DataBuffer(prompts(tok, N_PROMPTS), seed=0).get_prompts(2 * STEPS)
    ]
    backend = PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=1e-3, schedule="constant"), max_steps=STEPS,
        checkpoint_dir=out / "checkpoints", pack_length=None,
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip
    dump = RolloutDumpWriter(out / "rollouts.jsonl")
    config = ROLLOUT.model_copy(update={"workers": workers, "mode": mode})

    def saved(step: int, path: Path, metrics: dict) -> None:
        if states is not None:
            state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
            states[step] = state["extra"]["data_buffer"]

    async with SGLangEngine(url, max_retries=0) as engine:
        if workers:
            manager = WorkerRolloutManager([url] * workers, buffer, config, reward=REWARD,
                                           current_version=lambda: backend.weight_version)  # fmt: skip
        else:
            manager = AsyncRolloutManager(engine, buffer, config, reward_fn=answer_reward,
                                          current_version=lambda: backend.weight_version)  # fmt: skip
        with backend:
            async with manager, trio.open_nursery() as nursery:
                if during is not None:
                    nursery.start_soon(during, manager)
                history = await run_rl_training(
                    backend, buffer, manager, [engine],
                    RLLoopConfig(max_steps=STEPS, checkpoint_every=checkpoint_every,
                                 resume="auto" if resume else "never"),
                    objective=RLObjective(reinforce()), export_dir=out / "weights",
                    hooks=RLHooks(on_batch=dump, checkpoint_hook=saved),
                )  # fmt: skip
                nursery.cancel_scope.cancel()
    dump.close()
    return history, out / "rollouts.jsonl", drawn, manager


def _assert_same_updates(history: list[dict], reference: list[dict]) -> None:
    """Equal losses and gradient norms, up to float32 noise: the engine batches the requests
    of one process differently from two (its logprobs differ by <= 2e-6, its tokens not at
    all), and the loss sums terms of magnitude ~1 to ~1e-2 (so ~1e-6 absolute)."""
    assert len(history) == len(reference) == STEPS
    assert max(abs(h["loss"]) for h in reference) > 1e-3  # a real update to compare
    for key in ("loss", "grad_norm", "reward_mean", "response_len_mean"):
        assert [h[key] for h in history] == pytest.approx([h[key] for h in reference], rel=1e-4,
                                                          abs=2e-6), key  # fmt: skip


@pytest.fixture(scope="module")
def in_process_run(tiny_model_dir, tmp_path_factory):
    """The reference: the same 3 steps with generation in the trainer's process."""

    async def main():
        async with open_local_engine(tiny_model_dir, num_threads=1) as server:
            return await _run(tiny_model_dir, tmp_path_factory.mktemp("k0"), server.url, 0)

    return trio.run(main)


@pytest.fixture(scope="module")
def in_process_overlap_run(tiny_model_dir, tmp_path_factory):
    """The reference in overlap mode (greedy, so as deterministic as sync: batch k+1 is
    generated by the weights before step k, the push waiting for it)."""

    async def main():
        async with open_local_engine(tiny_model_dir, num_threads=1) as server:
            out = tmp_path_factory.mktemp("k0-overlap")
            return await _run(tiny_model_dir, out, server.url, 0, mode="overlap")

    return trio.run(main)


def _kill_worker_0_in_step_2(server, killed: list[int]):
    """SIGKILL worker 0 once the loop asked for its second batch and the engine runs worker 0's
    requests: sync mode, for that batch; overlap mode, for the third, prefetched meanwhile (the
    second was generated during step 1, and the push after it waited for it)."""

    async def kill(manager):
        scheduler = server.state.scheduler
        while True:
            running = [s.rid for s in scheduler.running if "-w0-" in s.rid]
            if manager.statistics().batches_served >= 2 and running:
                break
            await trio.sleep(0.005)
        killed.append(manager.workers[0].pid)
        os.kill(manager.workers[0].pid, signal.SIGKILL)

    return kill


async def test_two_workers_train_every_prompt_once_with_the_in_process_losses(
    tiny_model_dir, tmp_path, in_process_run
):
    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        history, dump, drawn, manager = await _run(tiny_model_dir, tmp_path, server.url, 2)
    audit = audit_rollout_dump(dump, max_lag=0, drawn=drawn, held=[])
    assert (audit.steps, audit.lost, audit.twice, audit.stale) == (STEPS, 0, 0, 0)
    assert audit.trained == STEPS * 2 * 2
    reference = in_process_run[0]
    _assert_same_updates(history, reference)
    assert manager.restarts == 0


async def test_a_worker_killed_mid_batch_is_restarted_and_its_groups_generated_again(
    tiny_model_dir, tmp_path, in_process_run
):
    killed: list[int] = []
    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        history, dump, drawn, manager = await _run(tiny_model_dir, tmp_path, server.url, 2,
                                                   during=_kill_worker_0_in_step_2(server, killed))  # fmt: skip
    assert killed and manager.workers[0].pid != killed[0] and manager.restarts == 1
    audit = audit_rollout_dump(dump, max_lag=0, drawn=drawn, held=[])
    assert (audit.steps, audit.lost, audit.twice, audit.stale) == (STEPS, 0, 0, 0)
    assert audit.trained == STEPS * 2 * 2
    # greedy: the groups generated again are the ones the dead worker would have returned
    reference = in_process_run[0]
    _assert_same_updates(history, reference)
    assert history[-1]["workers/restarts"] == 1.0


async def test_a_worker_lost_more_often_than_worker_restarts_ends_the_run_naming_the_setting(
    tiny_model_dir,
):
    config = ROLLOUT.model_copy(update={"workers": 1, "worker_restarts": 0})
    model_prompts = [PromptItem((11, 12, 13 + i), (), {"answer": str(i)}) for i in range(4)]
    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        manager = WorkerRolloutManager([server.url], DataBuffer(model_prompts, seed=0), config,
                                       reward=REWARD)  # fmt: skip
        async with manager, trio.open_nursery() as nursery:

            async def kill_once_generating():
                while not server.state.scheduler.running:
                    await trio.sleep(0.005)
                os.kill(manager.workers[0].pid, signal.SIGKILL)

            nursery.start_soon(kill_once_generating)
            with pytest.raises(RolloutsError, match=r"rollout worker 0 .*(died|ended).*lost 1 times in "
                               r"one batch, more than rollout.worker_restarts=0"):  # fmt: skip
                await manager.generate_batch()


async def test_a_worker_uses_no_engine_serving_older_weights_than_the_trainers_last_push(
    tiny_model_dir,
):
    """An engine back from a relaunch serves its initial weights ("0") until the trainer's pool
    gives it those of the last push ("1"): the worker's samples must all come from "1"."""
    config = ROLLOUT.model_copy(update={"workers": 1})
    items = [PromptItem((11, 12, 13 + i), (), {"answer": str(i)}) for i in range(4)]
    async with open_local_engine(tiny_model_dir, num_threads=1, weight_version="0") as server:
        scheduler = server.state.scheduler
        manager = WorkerRolloutManager([server.url], DataBuffer(items, seed=0), config,
                                       reward=REWARD, current_version=lambda: 1,
                                       engine_weights=lambda: "1")  # fmt: skip
        given: list[int] = []
        async with manager, trio.open_nursery() as nursery:

            async def rejoin_after_a_while():
                # the trainer's pool gives it the weights once the worker has asked it (its
                # 4 answers of 6 tokens take a fraction of a second; this waits 1 s more)
                while scheduler.generated_tokens == 0:
                    await trio.sleep(0.01)
                await trio.sleep(1.0)
                scheduler.weight_version = "1"
                given.append(scheduler.generated_tokens)

            nursery.start_soon(rejoin_after_a_while)
            batch = await manager.generate_batch()
    assert given, "the batch came back before the engine served the trainer's weights"
    assert [s.weight_version for s in batch.samples] == [1] * 4


async def test_a_replaced_worker_first_aborts_the_requests_the_lost_one_left_on_its_engines(
    tiny_model_dir,
):
    """Behind a proxy the engine never sees a killed worker's connections close: its requests
    would run to the end unread. The model thread is held from the kill until the new worker's
    requests arrive, so the old ones can only have ended by an abort."""
    config = ROLLOUT.model_copy(update={"workers": 1, "sampling": SamplingConfig(
        temperature=0.0, max_new_tokens=64)})  # fmt: skip
    items = [PromptItem((11, 12, 13 + i), (), {"answer": str(i)}) for i in range(4)]
    holding, release = threading.Event(), threading.Event()
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            trio.open_nursery() as nursery:  # fmt: skip
        scheduler = server.state.scheduler
        url = await nursery.start(FaultProxy(server.url, FaultPlan()).serve)
        manager = WorkerRolloutManager([url], DataBuffer(items, seed=0), config, reward=REWARD)
        seen: dict[str, list] = {}
        async with manager, trio.open_nursery() as inner:

            async def kill_then_watch():
                live = lambda: [s for s in (*scheduler.waiting, *scheduler.running)  # noqa: E731
                                if not s.finished]  # fmt: skip
                with trio.fail_after(60):  # the first worker's requests generate
                    while not [s for s in scheduler.running if s.prefilled]:
                        await trio.sleep(0.005)
                    inner.start_soon(scheduler.run_on_model_thread, _hold, holding, release)
                    while not holding.is_set():
                        await trio.sleep(0.005)
                    seen["old"] = live()
                    os.kill(manager.workers[0].pid, signal.SIGKILL)
                    while not (new := [s for s in live() if s not in seen["old"]]):
                        await trio.sleep(0.005)  # until the new worker's requests arrive
                seen["new"] = new
                seen["old_ended"] = [s.finish_reason for s in seen["old"]]
                release.set()

            inner.start_soon(kill_then_watch)
            try:
                batch = await manager.generate_batch()
            finally:
                release.set()
        nursery.cancel_scope.cancel()
    assert seen["old"] and manager.restarts == 1
    assert [r and r["type"] for r in seen["old_ended"]] == ["abort"] * len(seen["old"])
    # the new worker's requests have rids of their own: no abort of the old ones reaches them
    assert not {s.rid for s in seen["new"]} & {s.rid for s in seen["old"]}
    assert len(batch.samples) == 4


async def test_a_workers_requests_held_behind_a_trainers_push_longer_than_the_stall_bound_are_not_stalled(
    tiny_model_dir,
):
    """The trainer pauses the engine for a push (its client, not the worker's) while a worker's
    requests run, and holds it three times the worker's stall bound: they wait, are never taken
    for stalled (no abort, no rid sent twice) and finish once the push ends."""
    config = ROLLOUT.model_copy(update={"workers": 1, "mode": "overlap", "sampling":
                                        SamplingConfig(temperature=0.0, max_new_tokens=64)})  # fmt: skip
    stall = {"stall_floor_s": 2.0, "stall_s_per_token": 0.02}  # 3.28 s for 64 tokens
    items = [PromptItem((11, 12, 13 + i), (), {"answer": str(i)}) for i in range(4)]
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            SGLangEngine(server.url) as trainer, trio.open_nursery() as nursery:  # fmt: skip
        scheduler = server.state.scheduler
        proxy = FaultProxy(server.url, FaultPlan())
        paths: list[str] = []
        proxy.on_request = paths.append
        url = await nursery.start(proxy.serve)
        manager = WorkerRolloutManager(
            [url], DataBuffer(items, seed=0), config, reward=REWARD, engines=stall,
            paused_engines=lambda: {url} if trainer.paused else set())  # fmt: skip
        held: list[int] = []
        async with manager, trio.open_nursery() as inner:

            async def push_while_generating():
                with trio.fail_after(60):
                    while not [s for s in scheduler.running if s.prefilled]:
                        await trio.sleep(0.005)
                await trio.sleep(0.05)  # the requests' stall watch has run a while
                await trainer.pause("retract")  # the push's load: 3 x the stall bound
                held.append(sum(not s.finished for s in (*scheduler.waiting, *scheduler.running)))
                await trio.sleep(3 * (2.0 + 0.02 * 64))
                await trainer.resume()

            inner.start_soon(push_while_generating)
            batch = await manager.generate_batch()
        nursery.cancel_scope.cancel()
    assert held and held[0] > 0, "every request finished before the push paused the engine"
    assert "/abort_request" not in paths
    assert len(proxy.rids) == len(set(proxy.rids))  # none re-sent
    assert len(batch.samples) == 4 and batch.metrics["samples_failed"] == 0


async def test_a_push_that_begins_and_ends_around_a_collect_frame_leaves_the_worker_seeing_no_pause(
    tiny_model_dir,
):
    """The trainer's push pauses the engine just as a collect frame is built (its state:
    paused) and ends before the trainer next looks at its pauses, which it has already told the
    worker were none: the worker is told the push ended, so its stall watch counts again, and a
    /generate its engine never answers is given up at the stall bound (~1 s) and sent again,
    not left until rollout.worker_timeout_s."""
    config = ROLLOUT.model_copy(update={"workers": 1, "worker_timeout_s": 30.0,
                                        "worker_restarts": 0})  # fmt: skip
    stall = {"stall_floor_s": 1.0, "stall_s_per_token": 0.01}  # 1.06 s for 6 tokens
    items = [PromptItem((11, 12, 13 + i), (), {"answer": str(i)}) for i in range(2)]
    async with open_local_engine(tiny_model_dir, num_threads=1) as server, \
            trio.open_nursery() as nursery:  # fmt: skip
        proxy = FaultProxy(server.url, FaultPlan(script=("hang",), hang_s=60.0))
        url = await nursery.start(proxy.serve)
        pushing, looks = [False], [0]

        def paused_engines():  # one look sees the push: it ends right after
            looks[0] += 1
            seen, pushing[0] = pushing[0], False
            return {url} if seen else set()

        def engine_weights():  # read right before the collect frame's paused state
            pushing[0] = True
            return None

        manager = WorkerRolloutManager(
            [url], DataBuffer(items, seed=0), config, reward=REWARD, engines=stall,
            engine_weights=engine_weights, paused_engines=paused_engines)  # fmt: skip
        async with manager:
            with trio.fail_after(30):
                while looks[0] < 3:  # the worker was told: no pause (the first look's)
                    await trio.sleep(0.01)
            with trio.fail_after(60):
                batch = await manager.generate_batch()
        nursery.cancel_scope.cancel()
    assert proxy.counts["hang"] == 1 and manager.restarts == 0
    assert proxy.longest_s["/generate"] < 15.0  # given up at the stall bound, not at 30 s
    assert len(batch.samples) == 4 and batch.metrics["samples_failed"] == 0


def _hold(holding: threading.Event, release: threading.Event) -> None:
    """On the engine's model thread: no step runs until `release` (bounded: 60 s)."""
    holding.set()
    release.wait(60)


class _TrainerKilled(Exception):
    """Raised into the run: it ends there, as a killed trainer's would (no checkpoint after)."""


async def test_a_two_worker_run_killed_mid_step_resumes_to_train_the_uninterrupted_runs_prompts(
    tiny_model_dir, tmp_path, in_process_run
):
    async def kill_while_step_3_generates(manager):
        while manager.statistics().batches_served < STEPS:
            await trio.sleep(0.005)
        raise _TrainerKilled

    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        with pytest.RaisesGroup(_TrainerKilled, flatten_subgroups=True):
            await _run(tiny_model_dir, tmp_path, server.url, 2, checkpoint_every=1,
                       during=kill_while_step_3_generates)  # fmt: skip
        assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
            "step_000001", "step_000002"]  # fmt: skip
        history, dump, drawn, _ = await _run(tiny_model_dir, tmp_path, server.url, 2,
                                             checkpoint_every=1, resume=True)  # fmt: skip
    audit = audit_rollout_dump(dump, max_lag=0, drawn=drawn, held=[])
    assert (audit.steps, audit.lost, audit.twice, audit.stale) == (STEPS, 0, 0, 0)
    # step by step the prompts (and, greedy, the responses) of the uninterrupted run, in
    # whatever order its groups finished
    resumed, reference = read_rollout_dump(dump), read_rollout_dump(in_process_run[1])
    assert sorted(resumed) == sorted(reference) == list(range(1, STEPS + 1))
    for step in reference:
        assert sorted((s.prompt_ids, s.response_ids) for s in resumed[step].samples) == sorted(
            (s.prompt_ids, s.response_ids) for s in reference[step].samples), step  # fmt: skip
    assert [h["step"] for h in history][-1] == STEPS
    assert history[-1]["loss"] == pytest.approx(in_process_run[0][-1]["loss"], rel=1e-4, abs=2e-6)


async def test_two_workers_in_overlap_mode_train_every_prompt_once_with_the_in_process_losses(
    tiny_model_dir, tmp_path, in_process_overlap_run
):
    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        history, dump, drawn, _ = await _run(tiny_model_dir, tmp_path, server.url, 2,
                                             mode="overlap")  # fmt: skip
    audit = audit_rollout_dump(dump, max_lag=ROLLOUT_MODE_LAG["overlap"], drawn=drawn, held=[])
    assert (audit.steps, audit.lost, audit.twice, audit.stale) == (STEPS, 0, 0, 0)
    assert audit.trained == STEPS * 2 * 2
    _assert_same_updates(history, in_process_overlap_run[0])
    # batch k+1 was generated while step k trained: one version behind, as without workers
    assert [h["staleness_max"] for h in history] == [0.0, 1.0, 1.0]


async def test_a_worker_killed_while_overlap_mode_prefetches_is_restarted_with_nothing_lost(
    tiny_model_dir, tmp_path, in_process_overlap_run
):
    killed: list[int] = []
    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        # in step 2, worker 0 generates batch 3 while the trainer trains on batch 2
        history, dump, drawn, manager = await _run(tiny_model_dir, tmp_path, server.url, 2,
                                                   during=_kill_worker_0_in_step_2(server, killed),
                                                   mode="overlap")  # fmt: skip
    assert killed and manager.workers[0].pid != killed[0] and manager.restarts == 1
    audit = audit_rollout_dump(dump, max_lag=ROLLOUT_MODE_LAG["overlap"], drawn=drawn, held=[])
    assert (audit.steps, audit.lost, audit.twice, audit.stale) == (STEPS, 0, 0, 0)
    assert audit.trained == STEPS * 2 * 2
    _assert_same_updates(history, in_process_overlap_run[0])
    assert history[-1]["workers/restarts"] == 1.0


async def test_two_workers_in_async_mode_train_each_drawn_prompt_once_within_max_staleness(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    """Async timing decides which weights generate which group, so the losses are not K=0's;
    what holds is the accounting: at every checkpoint the prompts drawn are those trained plus
    those held (a resume trains each once), and no trained sample lags past max_staleness."""
    states: dict[int, dict] = {}
    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        _, dump, _, _ = await _run(tiny_model_dir, tmp_path, server.url, 2, mode="async",
                                   checkpoint_every=1, states=states)  # fmt: skip
    records = [p.prompt_ids for p in prompts(tiny_tokenizer, N_PROMPTS)]
    trained = [[s.prompt_ids for s in b.samples if s.index_in_group == 0]
               for _, b in read_dump_lines(dump)]  # fmt: skip
    assert [len(t) for t in trained] == [2] * STEPS
    ahead = 0
    for step, state in states.items():
        cursor = state["epoch_id"] * len(records) + state["sample_offset"]
        drawn = Counter(DataBuffer(records, seed=0).get_prompts(cursor))
        held = Counter(tuple(h["item"]["prompt"]["prompt_ids"]) for h in state["held"])
        done = Counter(p for t in trained[:step] for p in t)
        assert drawn == done + held, step
        ahead += cursor > sum(done.values())
    assert ahead  # the producer drew ahead of the trainer: the async case was tested
    final = states[STEPS]
    cursor = final["epoch_id"] * len(records) + final["sample_offset"]
    audit = audit_rollout_dump(dump, max_lag=ROLLOUT.max_staleness,
                               drawn=DataBuffer(records, seed=0).get_prompts(cursor),
                               held=[h["item"]["prompt"]["prompt_ids"] for h in final["held"]])  # fmt: skip
    assert (audit.steps, audit.lost, audit.twice, audit.stale) == (STEPS, 0, 0, 0)
    assert audit.trained == STEPS * 2 * 2


async def test_groups_a_pause_cuts_short_in_a_worker_are_held_in_the_checkpoint_not_trained(
    tiny_model_dir, tiny_tokenizer, capfd
):
    """A weight push pauses the engines with "abort" while a worker generates (async mode): its
    groups come back cut short, are held (in `data_state()`, what a checkpoint stores) and not
    trained, and the trainer draws replacements (the worker does not warn of a smaller batch);
    leaving the manager mid-collection leaves no request of its workers running."""
    items = prompts(tiny_tokenizer, N_PROMPTS)
    config = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                           mode="async", workers=1, sampling=SamplingConfig(max_new_tokens=800))  # fmt: skip
    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        scheduler = server.state.scheduler
        async with SGLangEngine(server.url, max_retries=0) as engine:
            manager = WorkerRolloutManager([server.url], DataBuffer(items, shuffle=False), config,
                                           reward=REWARD)  # fmt: skip
            async with manager:
                with trio.fail_after(60):  # the worker's first requests run at the engine
                    while not any("-w0-" in s.rid for s in scheduler.running):
                        await trio.sleep(0.005)
                await engine.pause("abort")
                await engine.resume()
                with trio.fail_after(120):
                    batch = await manager.generate_batch()
                state = manager.data_state()
                with trio.fail_after(60):  # the producer's next collection runs at the engine
                    while not any("-w0-" in s.rid for s in scheduler.running):
                        await trio.sleep(0.005)
            with trio.fail_after(5):  # ended, not left to run 800 tokens unread
                while scheduler.running or scheduler.waiting:
                    await trio.sleep(0.005)
    assert batch.metrics["groups_interrupted"] == 2  # both went out in the first request
    assert all(s.status in ("completed", "truncated") for s in batch.samples)
    index = {p.prompt_ids: i for i, p in enumerate(items)}
    assert sorted(index[g[0].prompt_ids] for g in batch.groups) == [2, 3]
    held = [index[tuple(h["item"]["prompt"]["prompt_ids"])] for h in state["held"]]
    assert sorted(held[:2]) == [0, 1]  # cut short: held first, trained later
    drawn = Counter(range(state["sample_offset"]))
    assert drawn == Counter(index[g[0].prompt_ids] for g in batch.groups) + Counter(held)
    assert "over-sampling cap" not in capfd.readouterr().err  # the workers' stderr is ours


async def test_surplus_groups_a_worker_returns_are_held_with_their_messages(
    tiny_model_dir, tiny_tokenizer
):
    """Over-sampling (`extra_groups`): the finished groups past the batch are held for a later
    batch with their prompts as drawn. They were held as token ids and metadata only, so an
    agent's or environment's episode generated from them again started with no messages."""
    items = prompts(tiny_tokenizer, N_PROMPTS)
    config = ROLLOUT.model_copy(update={"workers": 1, "extra_groups": 2})
    buffer = HoldsRecorded(items, shuffle=False)
    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        manager = WorkerRolloutManager([server.url], buffer, config, reward=REWARD)
        async with manager:
            with trio.fail_after(120):
                batch = await manager.generate_batch()
    held = [PromptItem.from_dict(r["prompt"]) for r in buffer.held_records]
    assert len(batch.groups) == 2 and len(held) == batch.metrics["groups_returned_partial"] == 2
    drawn = {p.prompt_ids: p for p in items}
    assert all(p == drawn[p.prompt_ids] and p.messages for p in held)
