"""`sync_weights_to_engines` over two local engines on loopback HTTP, served from this test's
process (`open_local_engine`: the same server as `rollouts serve`, without ~3.5 CPU s of
imports for each process; engine processes are tests/test_engine_launch.py's)."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from engines import (
    SGLangEngine,
    WeightSyncError,
    find_free_port,
    pause_engines,
    sync_weights_to_engines,
)
from engines.local import open_local_engine


async def test_sync_updates_both_engines_and_a_failure_names_the_engine_and_leaves_none_paused(
    tiny_model_dir, tiny_model_dir_seed1, tmp_path
):
    launched: dict[int, object] = {}
    both_up = trio.Event()

    async def run_engine(i: int) -> None:  # each engine lives in its own task until cancelled
        async with open_local_engine(tiny_model_dir, num_threads=1) as engine:
            launched[i] = engine
            if len(launched) == 2:
                both_up.set()
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        for i in range(2):  # start both at once
            nursery.start_soon(run_engine, i)
        await both_up.wait()
        launched_engines = [launched[0], launched[1]]
        engines = [
            await stack.enter_async_context(SGLangEngine(e.url, max_retries=0))
            for e in launched_engines
        ]
        prompt, params = [4, 5, 6, 7], {"max_new_tokens": 8, "temperature": 0}
        before = [await e.generate(prompt, params) for e in engines]

        duration = await sync_weights_to_engines(engines, tiny_model_dir_seed1, "step-1")
        assert duration > 0
        for engine in engines:
            info = await engine.model_info()
            assert (info.weight_version, info.model_path) == ("step-1", str(tiny_model_dir_seed1))
        after = [await e.generate(prompt, params) for e in engines]
        assert after[0].output_ids == after[1].output_ids and after[0].weight_version == "step-1"
        assert after[0].output_logprobs != before[0].output_logprobs

        # the server refuses (bad path): both fail with its message, keep step-1, none paused
        with pytest.raises(WeightSyncError) as info:
            await sync_weights_to_engines(engines, tmp_path / "no_such_checkpoint", "step-2")
        message = str(info.value)
        assert (
            all(e.url in message for e in engines) and "Failed to get weights iterator" in message
        )
        for engine in engines:
            assert (await engine.model_info()).weight_version == "step-1"

        # one engine is down: the sync skips it and goes on (an EnginePool gives it the weights
        # when it returns: `expected_weights`); only when every engine is down does it fail
        dead = await stack.enter_async_context(
            SGLangEngine(f"http://127.0.0.1:{find_free_port()}", max_retries=0)
        )
        await sync_weights_to_engines([engines[0], dead], tiny_model_dir, "step-3")
        assert dead.expected_weights == (str(tiny_model_dir), "step-3")
        with pytest.raises(WeightSyncError) as info:
            await sync_weights_to_engines([dead], tiny_model_dir, "step-3")
        assert dead.url in str(info.value) and "cannot reach the engine" in str(info.value)
        for engine in engines:
            state = (await engine.server_info())["internal_states"][0]
            assert state["paused"] is False
        with trio.fail_after(30):  # it serves at once: it was resumed
            result = await engines[0].generate(prompt, params)
        assert result.weight_version == "step-3" and result.output_ids == before[0].output_ids

        # pause first, load later (what the RL loop does): a request sent in between waits in
        # the engine and runs on the new weights
        await pause_engines(engines)
        waiting: list = []

        async def generate_while_paused() -> None:
            waiting.append(await engines[0].generate(prompt, params))

        async with trio.open_nursery() as requests:
            requests.start_soon(generate_while_paused)
            await trio.sleep(0.3)
            assert not waiting  # held by the paused engine
            await sync_weights_to_engines(engines, tiny_model_dir_seed1, "step-4", paused=True)
        assert waiting[0].weight_version == "step-4"
        assert waiting[0].output_ids == after[0].output_ids

        # a refused pause (here a 404) resumes the engines that were paused and names the one
        # that failed; a dead engine is skipped
        wrong = await stack.enter_async_context(
            SGLangEngine(f"{engines[0].url}/no_such_prefix", max_retries=0)
        )
        with pytest.raises(WeightSyncError) as info:
            await pause_engines([engines[1], wrong, dead])
        assert wrong.url in str(info.value) and engines[1].url not in str(info.value)
        assert (await engines[1].server_info())["internal_states"][0]["paused"] is False
        nursery.cancel_scope.cancel()


async def test_a_sync_cancelled_while_its_engine_goes_down_raises_cancelled_not_a_sync_error(
    local_engine, tiny_model_dir
):
    # A host that cancels training also tears its engines down: the resume after the update
    # then finds the engine gone. The cancel is the cause; a WeightSyncError would mask it.
    _, engine = local_engine
    async with SGLangEngine(f"http://127.0.0.1:{find_free_port()}", max_retries=0) as gone:
        with trio.CancelScope() as scope:

            class GoesDownWithTheCancel:
                def __getattr__(self, name):  # everything else is the live engine's
                    return getattr(engine, name)

                async def resume(self) -> None:
                    scope.cancel()
                    await gone.resume()  # nothing listens there: "cannot reach the engine"

            await sync_weights_to_engines([GoesDownWithTheCancel()], tiny_model_dir, "v1")
    assert scope.cancelled_caught
    await engine.resume()


async def test_an_engine_that_died_after_the_pause_is_skipped_as_down_not_failed(
    local_engine, tiny_model_dir
):
    # Paused, then gone before the flush (a process killed mid-push): like an engine found
    # dead at the pause, it is skipped and logged, and the live one takes the weights.
    _, engine = local_engine
    async with SGLangEngine(f"http://127.0.0.1:{find_free_port()}", max_retries=0) as gone:
        await engine.pause("abort")
        gone.paused = True
        await sync_weights_to_engines([engine, gone], tiny_model_dir, "v1", paused=True)
    assert (await engine.model_info()).weight_version == "v1"
    assert gone.expected_weights == (str(tiny_model_dir), "v1")  # given when it comes back
