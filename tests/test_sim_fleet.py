"""The simulated fleet (engines/testing/sim_fleet.py) behind the project's own client, pool and
manager, and the spreading of coalesced requests over a pool's engines (issue 31)."""

from __future__ import annotations

import time

import httpx
import trio

from engines import EnginePool, SGLangEngine, sync_weights_to_engines
from engines.testing.sim_fleet import SimEngineConfig, serve_sim_fleet
from rollouts.config import RolloutConfig
from rollouts.manager import AsyncRolloutManager
from rollouts.prompts import PromptItem
from training.data.buffer import DataBuffer


def _prompts(k: int) -> list[PromptItem]:
    return [PromptItem(tuple(range(5, 5 + 10 + i)), (), metadata={"i": i}) for i in range(k)]


def _reward(sample) -> float:
    return float(sample.response_ids[0] % 2)


def _config(groups: int, n: int, tokens: int) -> RolloutConfig:
    return RolloutConfig(batch_size=groups, n_samples_per_prompt=n, filter_groups="none",
                         max_concurrency=256, sampling={"max_new_tokens": tokens})  # fmt: skip


async def test_sim_fleet_serves_a_rollout_and_a_weight_sync_through_client_pool_and_manager(
    tmp_path,
):
    async with trio.open_nursery() as nursery:
        sims = await nursery.start(serve_sim_fleet, 2, SimEngineConfig(tokens_per_s=1e6))
        async with SGLangEngine(sims[0].url) as a, SGLangEngine(sims[1].url) as b:
            assert await a.check_server() == "0.5.23"
            async with EnginePool([a, b]) as pool:
                manager = AsyncRolloutManager(pool, DataBuffer(_prompts(8), shuffle=False),
                                              _config(4, 4, 32), reward_fn=_reward)  # fmt: skip
                async with manager:
                    first = await manager.generate_batch()
                    await sync_weights_to_engines([a, b], tmp_path, "1")
                    second = await manager.generate_batch()
        nursery.cancel_scope.cancel()
    for batch, version in ((first, 0), (second, 1)):
        samples = [s for g in batch.groups for s in g]
        assert len(batch.groups) == 4 and len(samples) == 16
        assert {len(s.response_ids) for s in samples} == {32}
        assert {len(s.rollout_logprobs) for s in samples} == {32}
        assert {s.status for s in samples} == {"completed"}
        assert {s.weight_version for s in samples} == {version}
    assert [s.weight_version for s in sims] == ["1", "1"]


async def test_sim_generate_answer_has_the_local_engines_shape(local_engine):
    server, _ = local_engine
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4},
            "return_logprob": True, "rid": "shape"}  # fmt: skip
    async with trio.open_nursery() as nursery:
        sims = await nursery.start(serve_sim_fleet, 1, SimEngineConfig())
        async with httpx.AsyncClient(timeout=60) as http:
            real = (await http.post(server.url + "/generate", json=body)).json()
            sim = (await http.post(sims[0].url + "/generate", json=body)).json()
            batch = await http.post(sims[0].url + "/generate",
                                    json={**body, "input_ids": [[1, 2]] * 3, "rid": list("xyz")})  # fmt: skip
        nursery.cancel_scope.cancel()
    assert sorted(sim) == sorted(real)
    assert sorted(sim["meta_info"]) == sorted(real["meta_info"])
    for key in ("output_token_logprobs", "input_token_logprobs", "weight_versions"):
        assert len(sim["meta_info"][key]) == len(real["meta_info"][key])
        assert [type(v) for v in sim["meta_info"][key][0]] == [
            type(v) for v in real["meta_info"][key][0]
        ] or key == "weight_versions"
    assert [r["meta_info"]["id"] for r in batch.json()] == ["x", "y", "z"]


async def test_sim_engine_holds_its_token_rate_and_latency_floor():
    rate, tokens = 20_000.0, 8 * 2 * 500
    async with trio.open_nursery() as nursery:
        sims = await nursery.start(serve_sim_fleet, 1, SimEngineConfig(tokens_per_s=rate,
                                                                         latency_s=0.3))  # fmt: skip
        async with SGLangEngine(sims[0].url) as engine:
            t0 = time.perf_counter()
            await engine.generate([1, 2], {"max_new_tokens": 1})
            floor = time.perf_counter() - t0
            t0 = time.perf_counter()
            async with trio.open_nursery() as requests:
                for _ in range(8):
                    requests.start_soon(engine.generate_batch, [[1, 2]] * 2,
                                        {"max_new_tokens": 500})  # fmt: skip
            burst = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    assert sims[0].stats.tokens == tokens + 1
    assert 0.3 <= floor < 1.5
    assert tokens / rate <= burst < 3 * tokens / rate  # 0.4 s of decode, never sooner


async def test_coalesced_groups_are_spread_over_every_engine_of_a_pool():
    async with trio.open_nursery() as nursery:
        sims = await nursery.start(serve_sim_fleet, 4, SimEngineConfig(tokens_per_s=1e6))
        engines = [SGLangEngine(s.url) for s in sims]
        async with engines[0], engines[1], engines[2], engines[3], EnginePool(engines) as pool:
            manager = AsyncRolloutManager(pool, DataBuffer(_prompts(8), shuffle=False),
                                          _config(8, 2, 16), reward_fn=_reward)  # fmt: skip
            async with manager:
                batch = await manager.generate_batch()
        nursery.cancel_scope.cancel()
    assert sum(len(g) for g in batch.groups) == 16
    # all 8 groups start at once and are merged: two requests per engine, 4 samples each
    assert [s.stats.samples for s in sims] == [4, 4, 4, 4]


def test_generate_answer_with_python_json_infinity_literals_still_parses():
    # orjson (when installed) refuses `-Infinity`, which Python's json.dumps writes for a -inf
    # logprob; the answer must still parse, as it did with json alone.
    from engines.http import decode_json
    from engines.types import parse_generate_response

    body = (b'{"text":"a","output_ids":[5,6],"meta_info":{"id":"r","finish_reason":{"type":'
            b'"length","length":2},"output_token_logprobs":[[-Infinity,5,null],[null,6,null]]}}')  # fmt: skip
    obj = decode_json(httpx.Response(200, content=body), "POST /generate", "http://x")
    result = parse_generate_response(obj, latency_s=0.0, prompt_len=1)
    assert result.output_ids == (5, 6)
    assert (
        result.output_logprobs[0] == float("-inf")
        and result.output_logprobs[1] != result.output_logprobs[1]
    )


def test_parsed_token_ids_share_one_int_per_value_and_keep_their_values():
    # JSON decoding makes a fresh int per token; held by the batch, those were most of its
    # memory (issue 31). Equal ids must be one object; odd ids still go through int().
    from engines.types import parse_generate_response

    def parse(ids):
        obj = {"text": "", "output_ids": ids, "meta_info": {"id": "r", "finish_reason": "stop"}}
        return parse_generate_response(obj, latency_s=0.0, prompt_len=1).output_ids

    first, second = parse([int("70000"), 5, 70000]), parse([int("70000")])
    assert first == (70000, 5, 70000) and first[0] is first[2] is second[0]
    assert parse([-1, 3]) == (-1, 3) and parse([2.0, 3]) == (2, 3) and parse([]) == ()
    assert parse([1 << 40]) == (1 << 40,)
