"""A pause with a lease (the project's extension of `/pause_generation`) ends by itself when its
holder stops renewing it: a trainer killed mid-sync must not leave the engine paused."""

from __future__ import annotations

import httpx
import trio


async def test_a_pause_whose_lease_is_not_renewed_ends_by_itself(local_engine, caplog):
    server, engine = local_engine
    done = trio.Event()

    async def generate() -> None:
        result = await engine.generate([1, 2, 3], {"max_new_tokens": 2})
        assert len(result.output_ids) == 2
        done.set()

    with trio.fail_after(15), caplog.at_level("WARNING"):
        async with httpx.AsyncClient(base_url=server.url) as http, trio.open_nursery() as nursery:
            pause = {"mode": "abort", "lease_s": 1.0}
            assert (await http.post("/pause_generation", json=pause)).status_code == 200
            started = trio.current_time()
            nursery.start_soon(generate)
            await trio.sleep(0.6)
            # a renewal: the request held behind the pause stays held (not aborted)
            assert (await http.post("/pause_generation", json=pause)).status_code == 200
            await trio.sleep(0.7)  # past the first lease's end, inside the renewed one
            assert not done.is_set()
            await done.wait()  # the renewed lease expires: the engine resumes by itself
            assert trio.current_time() - started >= 1.5
    assert "pause lease of 1.0 s expired" in caplog.text


async def test_a_pause_without_a_lease_is_sglangs_and_a_bad_lease_is_refused(local_engine):
    server, _ = local_engine
    async with httpx.AsyncClient(base_url=server.url) as http:
        bad = await http.post("/pause_generation", json={"mode": "abort", "lease_s": -1})
        assert bad.status_code == 400 and "lease_s" in bad.text
        assert (await http.post("/pause_generation", json={"mode": "abort"})).status_code == 200
        await trio.sleep(0.3)
        assert server.state.scheduler.paused and not server.state.pause_lease.held
        assert (await http.post("/continue_generation", json={})).status_code == 200


async def test_the_rl_recipe_resumes_an_engine_it_finds_paused(local_engine, caplog):
    from training.recipes.rl_engines import resume_if_paused

    server, engine = local_engine
    assert not await resume_if_paused(engine)  # running: left alone
    async with httpx.AsyncClient(base_url=server.url) as http:  # paused by hand, no lease
        assert (await http.post("/pause_generation", json={"mode": "abort"})).status_code == 200
    with caplog.at_level("WARNING"):
        assert await resume_if_paused(engine)
    assert not server.state.scheduler.paused and "left paused" in caplog.text
