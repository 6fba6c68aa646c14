"""The local engine's radix prefix cache over real HTTP, and weight syncs that leave no KV of the
old weights behind it (issue 25). References are the tiny HF models run in this process."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio
from test_engine_local import teacher_forced, wait_for

from engines import sync_weights_to_engines
from engines.local.prefix_cache import PrefixCache

PROMPT = list(range(10, 50))  # 40 tokens
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_hf_model_seed1(tiny_model_dir_seed1):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir_seed1).eval()


async def _generate(http: httpx.AsyncClient, ids, **body) -> dict:
    body = {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True, **body}
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _output_logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _close(got: list[float], want: list[float], tol: float = 1e-5) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < tol


async def test_a_repeated_prompt_reports_cached_tokens_and_the_logits_of_a_full_prefill(
    local_engine, tiny_hf_model
):
    server, _ = local_engine
    async with httpx.AsyncClient(base_url=server.url) as http:
        first = await _generate(http, PROMPT)
        again = await _generate(http, PROMPT)
        # SGLang's max_prefix_len: the prompt minus its last token (its logits are needed)
        assert [first["meta_info"]["cached_tokens"], again["meta_info"]["cached_tokens"]] == [0, 39]
        reference = teacher_forced(tiny_hf_model, PROMPT, first["output_ids"])
        assert again["output_ids"] == first["output_ids"]
        assert _close(_output_logprobs(again), reference)
        # input logprobs bound the match at logprob_start_len; those computed equal a full pass
        scored = await _generate(http, PROMPT, logprob_start_len=10)
        assert scored["meta_info"]["cached_tokens"] == 10
        entries = scored["meta_info"]["input_token_logprobs"]
        assert entries[0][0] is None and len(entries) == 30
        want = teacher_forced(tiny_hf_model, PROMPT[:11], PROMPT[11:])
        assert _close([lp for lp, _, _ in entries[1:]], want)
        # a batch whose rows hit different prefix lengths (and one nothing) in one prefill
        batch = [[*PROMPT[:25], 3, 4, 5], PROMPT + first["output_ids"][:4] + [7, 8], [60, 61, 62]]
        outs = await _generate(http, batch)
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [25, 44, 0]
        for prompt, out in zip(batch, outs, strict=True):
            assert _close(
                _output_logprobs(out), teacher_forced(tiny_hf_model, prompt, out["output_ids"])
            )


async def test_extra_key_namespaces_the_cache_with_sglang_validation(local_engine):
    server, _ = local_engine
    async with httpx.AsyncClient(base_url=server.url) as http:
        await _generate(http, PROMPT)
        cached = [(await _generate(http, PROMPT, extra_key=key))["meta_info"]["cached_tokens"]
                  for key in ("a", "a", "b", "")]  # fmt: skip
        assert cached == [0, 39, 0, 39]  # "" is no key, as in SGLang
        bad = await http.post("/generate", json={"input_ids": [[1], [2]], "extra_key": ["a"]})
        assert bad.status_code == 400
        assert "The length of extra_key should be equal to the batch size." in bad.text


async def test_flush_empties_the_cache_and_a_retract_pause_allows_it(local_engine):
    server, engine = local_engine
    async with httpx.AsyncClient(base_url=server.url) as http:
        await _generate(http, PROMPT)
        assert (await http.post("/flush_cache")).status_code == 200
        assert (await _generate(http, PROMPT))["meta_info"]["cached_tokens"] == 0
        async with trio.open_nursery() as nursery:
            long = {"max_new_tokens": 400, "ignore_eos": True}
            nursery.start_soon(engine.generate, [1, 2], long)
            await wait_for(lambda: _running(server))
            await engine.pause("retract")  # running -> waiting: SGLang flushes (paused)
            flushed = await http.post("/flush_cache")
            assert flushed.status_code == 200, flushed.text
            assert server.state.scheduler.runner._runner.prefix.total_tokens == 0
            await engine.resume()


async def _running(server) -> bool:
    running = server.state.scheduler.running
    return bool(running) and len(running[0].output_ids) >= 3


async def _sync_with_a_request_in_flight(server, engine, new_dir, mode: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.generate, [1, 2], {"max_new_tokens": 150, "ignore_eos": True})
        await wait_for(lambda: _running(server))
        with trio.fail_after(60):
            await sync_weights_to_engines([engine], new_dir, "v1", pause_mode=mode)


async def test_after_a_retract_sync_a_cached_prompt_reuses_nothing_from_the_old_weights(
    local_engine, tiny_model_dir_seed1, tiny_hf_model_seed1
):
    server, engine = local_engine
    async with httpx.AsyncClient(base_url=server.url) as http:  # no extra_key: any client
        await _generate(http, PROMPT)  # the prefix is cached under the old weights
        await _sync_with_a_request_in_flight(server, engine, tiny_model_dir_seed1, "retract")
        out = await _generate(http, PROMPT)
    assert out["meta_info"]["weight_version"] == "v1"
    want = teacher_forced(tiny_hf_model_seed1, PROMPT, out["output_ids"])
    assert _close(_output_logprobs(out), want), (_output_logprobs(out), want)
    assert out["meta_info"]["cached_tokens"] == 0


async def test_after_an_in_place_sync_the_clients_requests_reuse_nothing_from_the_old_weights(
    local_engine, tiny_model_dir_seed1, tiny_hf_model_seed1
):
    server, engine = local_engine
    await engine.generate(PROMPT, GREEDY)  # cached under the client's namespace, old weights
    assert (await engine.generate(PROMPT, GREEDY)).cached_tokens == 39
    await _sync_with_a_request_in_flight(server, engine, tiny_model_dir_seed1, "in_place")
    result = await engine.generate(PROMPT, GREEDY)
    assert result.weight_version == "v1"
    want = teacher_forced(tiny_hf_model_seed1, PROMPT, list(result.output_ids))
    assert _close(list(result.output_logprobs), want), (result.output_logprobs, want)
    assert result.cached_tokens == 0


def test_the_cache_evicts_least_recently_used_leaves_past_its_token_budget():
    def kv(n: int):
        return [
            (torch.full((2, n, 4), float(i)), torch.full((2, n, 4), -float(i))) for i in range(3)
        ]

    cache = PrefixCache(max_tokens=30)
    base = cache.namespace(None, None)
    shared = list(range(10))
    cache.insert(base, shared + [1] * 10, kv(20))
    cache.insert(base, shared + [2] * 10, kv(20))  # splits the edge after 10 tokens
    assert cache.total_tokens == 30
    assert cache.match(base, shared + [1] * 10, 100)[0] == 20  # touch the first branch
    cache.insert(base, [7] * 5, kv(5))  # over budget: the [2]-branch is the LRU leaf
    assert cache.total_tokens == 25
    assert cache.match(base, shared + [2] * 10, 100)[0] == 10
    length, got = cache.match(base, shared + [1] * 3, 12)
    assert length == 12 and got is not None and tuple(got[0][0].shape) == (1, 2, 12, 4)
    assert cache.match(cache.namespace("k", None), shared, 100) == (0, None)
    cache.clear()
    assert cache.total_tokens == 0 and cache.match(base, shared, 100) == (0, None)


def _greedy_reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation of `prompt` and its logprobs: what a fresh engine answers."""
    ids: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([prompt + ids])).logits[0, -1].argmax()))
    return ids, teacher_forced(model, prompt, ids)


async def test_after_an_in_place_sync_a_request_queued_before_the_pause_reuses_no_old_kv(
    tiny_model_dir, tiny_model_dir_seed1, tiny_hf_model_seed1
):
    from engines import SGLangEngine
    from engines.local import open_local_engine

    # one running request at a time, so the second one waits in the engine's queue
    async with (
        open_local_engine(tiny_model_dir, num_threads=1, max_running_requests=1) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):
        await engine.generate(PROMPT, GREEDY)  # PROMPT cached under the client's namespace
        results = []
        async with trio.open_nursery() as nursery:
            long = {"max_new_tokens": 150, "ignore_eos": True}
            nursery.start_soon(engine.generate, [1, 2], long)
            await wait_for(lambda: _running(server))

            async def queued() -> None:
                results.append(await engine.generate(PROMPT, GREEDY))

            nursery.start_soon(queued)  # carries the namespace of before the pause
            await wait_for(lambda: _queued(server, PROMPT))
            with trio.fail_after(60):
                await sync_weights_to_engines([engine], tiny_model_dir_seed1, "v1",
                                              pause_mode="in_place")  # fmt: skip
    (result,) = results
    assert result.weight_version == "v1"
    want_ids, want = _greedy_reference(tiny_hf_model_seed1, PROMPT, 6)
    assert list(result.output_ids) == want_ids
    assert _close(list(result.output_logprobs), want), (result.output_logprobs, want)


async def _queued(server, prompt: list[int]) -> bool:
    return any(s.item.input_ids == prompt for s in server.state.scheduler.waiting)


async def test_after_an_in_place_sync_requests_without_extra_key_reuse_no_old_kv(
    local_engine, tiny_model_dir_seed1, tiny_hf_model_seed1
):
    server, engine = local_engine
    completion = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                  "logprobs": 0}  # fmt: skip
    async with httpx.AsyncClient(base_url=server.url) as http:  # no extra_key: curl, OpenAI
        await _generate(http, PROMPT)  # cached under no key, old weights
        assert (await http.post("/v1/completions", json=completion)).status_code == 200
        await _sync_with_a_request_in_flight(server, engine, tiny_model_dir_seed1, "in_place")
        native = await _generate(http, PROMPT)
        response = await http.post("/v1/completions", json=completion)
    assert response.status_code == 200, response.text
    openai = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    want_ids, want = _greedy_reference(tiny_hf_model_seed1, PROMPT, 6)
    assert native["meta_info"]["weight_version"] == "v1"
    assert native["output_ids"] == want_ids
    assert _close(_output_logprobs(native), want), (_output_logprobs(native), want)
    assert _close(openai, want), (openai, want)
