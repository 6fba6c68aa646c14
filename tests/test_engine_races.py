"""Check-then-act races across `await` points on the engine side (an `EnginePool`'s membership
and answer checks, `RouterEngine`, a client's pause lease, the local engine's memory release,
also against a request whose evicted LoRA adapter is being reloaded), made deterministic: a
real local engine over loopback, and a client (`SGLangEngine` subclass) or its network (an
httpx transport) that holds one call on a `trio.Event` (or the engine's model thread on a
`threading.Event`) while another path runs (CI once failed on such a race: one outage gave an engine the weights twice)."""

from __future__ import annotations

import threading

import httpx
import pytest
import trio
from lora_helpers import GREEDY, LORA, PROMPTS, adapters_fixture  # noqa: F401  (fixture)
from test_engine_pool import run_engine, wait_for

from engines import (
    EngineError,
    EnginePool,
    SGLangEngine,
    find_free_port,
    sync_weights_to_engines,
)
from engines.local import open_local_engine
from engines.router import RouterEngine
from engines.testing.gateway import open_gateway


class Held(SGLangEngine):
    """Once `held` names a method ("model_info", "generate", "resume", ...), its next call
    waits for `release`: before the request (`before=True`) or once it has its answer (then
    `answered` is set). `returned` is set once that call returns (the caller then runs on
    without a checkpoint until its next await)."""

    def __init__(self, url: str, **kw) -> None:
        super().__init__(url, max_retries=0, **kw)
        self.held: str | None = None
        self.before = False
        self.release = trio.Event()
        self.answered = self.returned = False

    async def _hold(self, name: str, call):
        if self.held != name:
            return await call()
        self.held = None
        if self.before:
            await self.release.wait()
            out = await call()
        else:
            out = await call()
            self.answered = True
            await self.release.wait()
        self.returned = True
        return out

    async def model_info(self):
        return await self._hold("model_info", super().model_info)

    async def is_healthy(self):
        return await self._hold("is_healthy", super().is_healthy)

    async def generate(self, *args, **kwargs):
        call = super().generate
        return await self._hold("generate", lambda: call(*args, **kwargs))

    async def resume(self):
        return await self._hold("resume", super().resume)

    async def update_weights_from_disk(self, *args, **kwargs):
        call = super().update_weights_from_disk
        return await self._hold("update_weights_from_disk", lambda: call(*args, **kwargs))


async def test_a_probe_answer_from_before_a_rejoin_does_not_mark_the_rejoined_engine_down(
    tiny_model_dir,
):
    # A version probe got its answer from the engine restarted on its initial weights, then a
    # supervisor's "down" and "up" had it rejoin with the current weights before the probe
    # compared: the old answer marked the engine, now right, down as restarted, so one outage
    # gave the weights twice and counted rejoined == 2.
    send, events = trio.open_memory_channel[tuple[str, str]](8)
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        engine = Held(live.url)
        async with engine:
            await sync_weights_to_engines([engine], tiny_model_dir, "1")
            await engine.update_weight_version("0", abort_all_requests=False)  # as restarted
            engine.held = "model_info"
            async with EnginePool([engine], probe_interval_s=10, engine_events=events) as pool:
                await wait_for(lambda: engine.held is None, 5)  # the probe has "0", and waits
                await send.send(("down", live.url))
                await send.send(("up", live.url))
                await wait_for(lambda: pool.statistics().engines[0].rejoined == 1, 10)
                assert (await engine.model_info()).weight_version == "1"
                engine.release.set()
                await wait_for(lambda: engine.returned, 5)  # the probe has compared
                stats = pool.statistics().engines[0]
                assert (stats.healthy, stats.down_reason, stats.rejoined) == (True, None, 1)
        nursery.cancel_scope.cancel()


async def test_a_supervisors_down_during_a_rejoin_keeps_the_engine_down(tiny_model_dir):
    # The rejoin had given the weights (its last call answered) when the supervisor saw the
    # process exit: that "down" found the engine already down and did nothing, and the rejoin
    # then marked the dead engine up, so requests went to it (and its relaunch's "up", finding
    # it up, was ignored: the relaunch served its initial weights until a request failed).
    send, events = trio.open_memory_channel[tuple[str, str]](8)
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        engine = Held(live.url)
        async with engine, EnginePool([engine], probe_interval_s=60, engine_events=events) as pool:
            await sync_weights_to_engines([engine], tiny_model_dir, "1")
            await send.send(("down", live.url))
            await wait_for(lambda: not pool.statistics().engines[0].healthy, 5)
            engine.held = "resume"  # the rejoin's last call answers, and it waits
            await send.send(("up", live.url))
            await wait_for(lambda: engine.held is None, 10)
            await send.send(("down", live.url))  # the process exits now
            await wait_for(lambda: send.statistics().current_buffer_used == 0, 5)
            engine.release.set()
            await wait_for(lambda: not pool._slots[0].rejoining, 10)  # the rejoin is over
            stats = pool.statistics().engines[0]
            assert (stats.healthy, stats.rejoined) == (False, 0)
            assert "supervisor" in (stats.down_reason or "")
            await send.send(("up", live.url))  # its relaunch answers: given the weights
            await wait_for(lambda: pool.statistics().engines[0].healthy, 10)
            assert pool.statistics().engines[0].rejoined == 1
        nursery.cancel_scope.cancel()


class Loads(Held):
    """`Held`, counting the weight loads it sends."""

    def __init__(self, url: str, **kw) -> None:
        super().__init__(url, **kw)
        self.loads = 0

    async def update_weights_from_disk(self, *args, **kwargs):
        self.loads += 1
        return await super().update_weights_from_disk(*args, **kwargs)


async def test_a_relaunch_that_answers_during_a_rejoin_of_the_process_before_is_given_the_weights(
    tiny_model_dir,
):
    # The supervisor's "down" and its relaunch's "up" both came while a rejoin gave the weights
    # to the process that exited: the "up" found a rejoin under way and did nothing, so the
    # relaunch (on its initial weights) was either marked up by that rejoin or left down
    # until a probe; it must be given the weights itself, at once.
    send, events = trio.open_memory_channel[tuple[str, str]](8)
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        engine = Loads(live.url)
        async with engine, EnginePool([engine], probe_interval_s=60, engine_events=events) as pool:
            await sync_weights_to_engines([engine], tiny_model_dir, "1")
            await send.send(("down", live.url))
            await wait_for(lambda: not pool.statistics().engines[0].healthy, 5)
            loads = engine.loads
            engine.held = "resume"  # the rejoin's last call answers, and it waits
            await send.send(("up", live.url))
            await wait_for(lambda: engine.held is None, 10)
            await send.send(("down", live.url))  # the process exits...
            await send.send(("up", live.url))  # ...and its relaunch answers
            await wait_for(lambda: send.statistics().current_buffer_used == 0, 5)
            engine.release.set()
            await wait_for(lambda: pool.statistics().engines[0].healthy, 10)
            stats = pool.statistics().engines[0]
            assert (stats.rejoined, engine.loads - loads) == (1, 2)  # the relaunch's own load
        nursery.cancel_scope.cancel()


async def test_a_push_that_skips_an_engine_being_rejoined_leaves_the_rejoins_pause_held(
    tiny_model_dir, tiny_model_dir_seed1
):
    # A push skips an engine the pool knows is down and drops this client's hold of its
    # pause (it was held by a push before it died, issue 49): but the pool's rejoin held that
    # pause, loading the weights. Its lease was then no longer renewed, and the engine resumed
    # generation, in the middle of the load, one lease later.
    send, events = trio.open_memory_channel[tuple[str, str]](8)
    lease_s = 1.2  # renewed every 0.4 s; it runs out 1.2 s after the last renewal
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        other = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        engine = Held(live.url, pause_lease_s=lease_s)
        async with engine, SGLangEngine(other.url) as b, \
                EnginePool([engine, b], probe_interval_s=60, engine_events=events) as pool:  # fmt: skip
            await sync_weights_to_engines([engine, b], tiny_model_dir, "1")
            await send.send(("down", live.url))
            await wait_for(lambda: not pool.statistics().engines[0].healthy, 5)
            engine.held, engine.before = "update_weights_from_disk", True
            await send.send(("up", live.url))
            await wait_for(lambda: engine.held is None, 10)  # the rejoin has it paused, loading
            await sync_weights_to_engines([engine, b], tiny_model_dir_seed1, "2")  # skips it
            assert engine.paused  # the rejoin still holds its pause...
            await trio.sleep(2.0)  # ...and renews it: the lease does not run out
            assert live.state.scheduler.paused
            engine.release.set()
            await wait_for(lambda: pool.statistics().engines[0].healthy, 10)
            assert (await engine.model_info()).weight_version == "2"  # the push's, meanwhile
            assert not engine.paused and not live.state.scheduler.paused
        nursery.cancel_scope.cancel()


async def test_a_request_that_arrives_while_the_memory_is_being_released_is_refused_not_failed(
    tiny_model_dir,
):
    # The release checked the engine idle, then waited for the model thread: a /generate that
    # came meanwhile (a pool's health probe, a late request) still found the memory in place,
    # was queued, and its step ran on the released weights: a 500 "Internal error in the model
    # step" (and a traceback in the log) instead of the 400 naming the release.
    gate = threading.Event()
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        scheduler = live.state.scheduler
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as http:
            answers: dict[str, httpx.Response] = {}

            async def post(name: str, path: str, body: dict) -> None:
                answers[name] = await http.post(path, json=body)

            async def model_thread_busy() -> None:  # e.g. an adapter load before the release
                await scheduler.run_on_model_thread(gate.wait)

            nursery.start_soon(model_thread_busy)
            try:  # the model thread is freed whatever happens (a thread is not cancellable)
                await wait_for(lambda: scheduler._limiter.borrowed_tokens == 1, 5)
                nursery.start_soon(post, "release", "/release_memory_occupation", {})
                await wait_for(lambda: scheduler._limiter.statistics().tasks_waiting == 1, 5)
                nursery.start_soon(post, "generate", "/generate", {
                    "input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
                await wait_for(lambda: scheduler.busy or "generate" in answers, 5)
            finally:
                gate.set()
            await wait_for(lambda: len(answers) == 2, 10)
            assert answers["release"].status_code == 200
            generate = answers["generate"]
            assert generate.status_code == 400, generate.text
            assert "/release_memory_occupation" in generate.text
        nursery.cancel_scope.cancel()


async def test_a_request_whose_adapter_is_reloaded_while_the_memory_is_released_is_refused(
    tiny_model_dir, adapters
):
    # A request sent during a pause names an evicted adapter, resolved once the pause ends (as
    # SGLang does): the scheduler found the memory in place, then awaited the adapter's reload
    # on the model thread; a release that came meanwhile found the engine idle (the request not
    # queued yet) and ran first, and the request's step ran on the released weights: a 500
    # "Internal error in the model step" instead of the 400 naming the release.
    gate = threading.Event()
    options = {**LORA, "max_loras_per_batch": 2, "max_loaded_loras": 2}
    async with open_local_engine(tiny_model_dir, num_threads=1, **options) as server, \
            SGLangEngine(server.url, max_retries=0) as engine, \
            httpx.AsyncClient(base_url=server.url, timeout=30) as http, \
            trio.open_nursery() as nursery:  # fmt: skip
        scheduler = server.state.scheduler
        for name in ("a1", "a2", "b1"):  # a third one evicts a1, the least recently used
            await engine.load_lora_adapter(name, adapters["a2" if name == "b1" else name])
        answers: dict[str, httpx.Response] = {}

        async def post(name: str, path: str, body: dict) -> None:
            answers[name] = await http.post(path, json=body)

        async def model_thread_busy() -> None:  # e.g. a step: the reload waits for it
            await scheduler.run_on_model_thread(gate.wait)

        await engine.pause("abort")
        nursery.start_soon(model_thread_busy)
        try:  # the model thread is freed whatever happens (a thread is not cancellable)
            await wait_for(lambda: scheduler._limiter.borrowed_tokens == 1, 5)
            nursery.start_soon(post, "generate", "/generate", {
                "input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "a1"})  # fmt: skip
            await wait_for(lambda: len(scheduler.held) == 1, 5)
            await engine.resume()  # the request goes on: a1 is reloaded, on the model thread
            await wait_for(lambda: scheduler._limiter.statistics().tasks_waiting == 1, 5)
            nursery.start_soon(post, "release", "/release_memory_occupation", {})
            await wait_for(lambda: scheduler._limiter.statistics().tasks_waiting == 2
                           or "release" in answers, 5)  # fmt: skip
        finally:
            gate.set()
        await wait_for(lambda: len(answers) == 2, 30)
        assert answers["release"].status_code == 200, answers["release"].text
        generate = answers["generate"]
        assert generate.status_code == 400, generate.text
        assert "/release_memory_occupation" in generate.text
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("follows_weights", [False, True])
async def test_an_answer_from_the_weights_of_when_it_was_sent_is_not_stale_once_a_push_lands(
    tiny_model_dir, tiny_model_dir_seed1, follows_weights
):
    # The pool read the expected version only once the answer was in: a push that landed
    # between the answer and that check (the trainer's own, or, for a rollout worker's pool,
    # the trainer's that the worker heard of first) made the answer of the weights the request
    # was sent to look stale, and marked the healthy engine down.
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        engine = Held(live.url)
        async with (
            engine,
            SGLangEngine(live.url) as trainer,
            EnginePool(
                [engine],
                probe_interval_s=60,
                unavailable_timeout_s=2,
                follows_weights=follows_weights,
            ) as pool,
        ):
            await sync_weights_to_engines([trainer if follows_weights else engine],
                                          tiny_model_dir, "5")  # fmt: skip
            pool.expect_weights("5") if follows_weights else None
            answers: list = []

            async def generate() -> None:
                try:
                    answers.append(await pool.generate([4, 5, 6], {"max_new_tokens": 2}))
                except Exception as exc:  # the assertion names it
                    answers.append(exc)

            engine.held = "generate"
            nursery.start_soon(generate)
            await wait_for(lambda: engine.answered, 10)  # answered by "5": it waits
            if follows_weights:  # the trainer pushes, and tells the worker
                await sync_weights_to_engines([trainer], tiny_model_dir_seed1, "6")
                pool.expect_weights("6")
            else:
                await sync_weights_to_engines([engine], tiny_model_dir_seed1, "6")
            engine.release.set()
            await wait_for(lambda: bool(answers), 10)
            assert getattr(answers[0], "weight_version", answers[0]) == "5"
            stats = pool.statistics().engines[0]
            assert (stats.healthy, stats.failed, stats.down_reason) == (True, 0, None)
        nursery.cancel_scope.cancel()


async def test_an_answer_through_the_gateway_is_not_sent_again_when_a_push_lands_before_its_check(
    tiny_model_dir, tiny_model_dir_seed1
):
    # RouterEngine read the workers' expected version only once the answer was in: a push
    # between the two made the answer of the weights it was sent to look stale, and the
    # request was generated again (up to `max_stale_retries` times, then raised).
    async with trio.open_nursery() as nursery:
        worker = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        async with (
            open_gateway([worker.url]) as (url, stats),
            SGLangEngine(worker.url, max_retries=0) as client,
            RouterEngine(Held(url), [client], max_stale_retries=0) as router,
        ):  # fmt: skip
            await sync_weights_to_engines([client], tiny_model_dir, "5")
            gateway: Held = router.gateway  # type: ignore[assignment]
            answers: list = []

            async def generate() -> None:
                try:
                    answers.append(await router.generate([4, 5, 6], {"max_new_tokens": 2}))
                except Exception as exc:  # the assertion names it
                    answers.append(exc)

            gateway.held = "generate"
            nursery.start_soon(generate)
            await wait_for(lambda: gateway.answered, 10)  # answered by "5": it waits
            await sync_weights_to_engines([client], tiny_model_dir_seed1, "6")
            gateway.release.set()
            await wait_for(lambda: bool(answers), 10)
            assert getattr(answers[0], "weight_version", answers[0]) == "5"
            assert sum(stats.forwarded.values()) == 1  # generated once
        nursery.cancel_scope.cancel()


class HeldPause(httpx.AsyncBaseTransport):
    """The network between a client and its engine: once `armed`, the next pause that is not a
    lease renewal ("in_place") waits for `release` before it goes out (`holding` meanwhile)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.armed = self.holding = False
        self.release = trio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if (
            self.armed
            and request.url.path == "/pause_generation"
            and b"in_place" not in (request.content)
        ):
            self.armed, self.holding = False, True
            await self.release.wait()
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_lease_renewal_sent_while_its_pause_is_on_the_way_does_not_take_its_place(
    tiny_model_dir,
):
    # The client counts the engine paused from the moment it sends the pause: a renewal of the
    # lease sent before the pause got there paused the engine "in_place" (a renewal's mode),
    # and the engine took the pause that followed for a renewal: the request it was to abort
    # kept its place, the flush before the load was refused, and the sync failed.
    lease_s = 0.6
    net = HeldPause()
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        scheduler = live.state.scheduler
        async with (
            SGLangEngine(live.url, max_retries=0, transport=net, pause_lease_s=lease_s) as engine,
            SGLangEngine(live.url, max_retries=0) as other,
        ):  # fmt: skip
            done: dict[str, object] = {}

            async def long_request() -> None:  # another client's, aborted by the push's pause
                done["request"] = await other.generate(
                    [4, 5, 6], {"max_new_tokens": 1000, "ignore_eos": True})  # fmt: skip

            async def push() -> None:
                try:
                    done["push"] = await sync_weights_to_engines([engine], tiny_model_dir, "1")
                except Exception as exc:  # the assertion names it
                    done["push"] = exc

            nursery.start_soon(long_request)
            await wait_for(lambda: bool(scheduler.running), 10)
            net.armed = True
            nursery.start_soon(push)
            await wait_for(lambda: net.holding, 10)  # the pause is on its way
            with trio.move_on_after(5 * lease_s):  # renewals are due every lease_s / 3
                await wait_for(lambda: live.state.pause_lease.held)  # one got there first
            net.release.set()
            await wait_for(lambda: len(done) == 2, 30)
            assert isinstance(done["push"], float), done["push"]
            assert done["request"].aborted  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()


class HeldContinue(httpx.AsyncBaseTransport):
    """The network between a client and its engine: `fail` answers the next
    `/continue_generation` 500 without sending it (it never gets there); once `armed`, the
    next one waits for `release` before it goes out (`holding` meanwhile)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.fail = self.armed = self.holding = False
        self.release = trio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/continue_generation":
            if self.fail:
                self.fail = False
                return httpx.Response(500, json={"error": {"message": "lost on the way"}})
            if self.armed:
                self.armed, self.holding = False, True
                await self.release.wait()
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_retried_resume_that_a_new_pause_overtakes_leaves_the_client_and_engine_paused(
    tiny_model_dir,
):
    # A resume that failed is sent again (a pool's probe: `retry_resume`); a push's pause sent
    # while that retry is on the way must end paused, and counted so by the client (which would
    # otherwise send requests that wait behind it, its stall watch and probes thinking it
    # serves), and a retry after that pause must not end it.
    net = HeldContinue()
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        scheduler = live.state.scheduler
        async with SGLangEngine(live.url, max_retries=0, transport=net,
                                pause_lease_s=None) as engine:  # fmt: skip
            await engine.pause("abort")
            net.fail = True
            with pytest.raises(EngineError, match="lost on the way"):
                await engine.resume()
            assert engine.paused and engine.resume_wanted and scheduler.paused
            net.armed = True
            nursery.start_soon(engine.retry_resume)
            await wait_for(lambda: net.holding, 10)  # the retry is on its way
            pausing = trio.Event()

            async def push_pause() -> None:
                await engine.pause("abort")
                pausing.set()

            nursery.start_soon(push_pause)
            await wait_for(lambda: not engine.resume_wanted, 10)  # the pause has begun
            net.release.set()
            with trio.fail_after(10):
                await pausing.wait()
            assert engine.paused and scheduler.paused
            await engine.retry_resume()  # nothing to retry: the push's pause holds it
            assert engine.paused and scheduler.paused
            await engine.resume()
            assert not engine.paused and not scheduler.paused
        nursery.cancel_scope.cancel()


async def test_an_engine_back_once_is_given_the_weights_and_counted_once_whichever_paths_find_it(
    tiny_model_dir, tiny_model_dir_seed1
):
    # CI found rejoined == 2 after one outage: a rejoin that began after another had already
    # marked the engine up (its probe answered meanwhile) gave it the weights again and counted
    # a second return
    send, recv = trio.open_memory_channel[tuple[str, str]](10)
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        engine = Loads(live.url)
        async with engine, EnginePool([engine], probe_interval_s=60, engine_events=recv) as pool:
            await sync_weights_to_engines([engine], tiny_model_dir_seed1, "1")
            loads_before = engine.loads
            await send.send(("down", live.url))
            await wait_for(lambda: not pool.statistics().engines[0].healthy, 5)
            left: list[tuple[str, ...]] = []

            async def run_end() -> None:
                left.append(await pool.rejoin_down(30.0))

            engine.held, engine.before = "is_healthy", True
            nursery.start_soon(run_end)  # its probe of the engine waits...
            await wait_for(lambda: engine.held is None, 5)
            await send.send(("up", live.url))  # ...while the supervisor's word rejoins it
            await wait_for(lambda: pool.statistics().engines[0].rejoined >= 1, 10)
            engine.release.set()  # then the probe answers
            await wait_for(lambda: bool(left), 10)
            await trio.sleep(0.2)  # a second rejoin, if any, has run by now
            stats = pool.statistics().engines[0]
            assert left == [()] and stats.healthy
            assert (stats.rejoined, engine.loads - loads_before) == (1, 1)
        nursery.cancel_scope.cancel()


async def test_a_push_that_lands_while_a_probe_waits_for_its_answer_marks_nothing_down(
    tiny_model_dir, tiny_model_dir_seed1
):
    # the probe read the expected version before its /model_info, the push moved both the
    # engine and the expectation meanwhile: comparing the new answer with the old expectation
    # marked a healthy engine on the right weights down as restarted
    async with trio.open_nursery() as nursery:
        live = await nursery.start(run_engine, tiny_model_dir, find_free_port())
        engine = Held(live.url)
        async with engine:
            await sync_weights_to_engines([engine], tiny_model_dir, "1")
            engine.held, engine.before = "model_info", True
            async with EnginePool([engine], probe_interval_s=10) as pool:
                await wait_for(lambda: engine.held is None, 5)  # the first round's probe waits
                await sync_weights_to_engines([engine], tiny_model_dir_seed1, "2")
                engine.release.set()
                await trio.sleep(0.5)  # the probe has compared by now
                stats = pool.statistics().engines[0]
                assert (stats.healthy, stats.down_reason) == (True, None)
        nursery.cancel_scope.cancel()
