"""The local engine's control plane over real HTTP: abort, pause/continue, weight updates,
streaming, the OpenAI-compatible routes (with the official `openai` client) and the API key."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import httpx
import pytest
import trio
from safetensors.torch import load_file, save_file
from test_engine_local import internal_state, teacher_forced, wait_for

from engines import EngineError, SGLangEngine
from engines.local import open_local_engine

LONG = {"max_new_tokens": 1000, "ignore_eos": True}


async def _state_is(
    engine: SGLangEngine,
    *,
    running: int | None = None,
    waiting: int | None = None,
    held: int | None = None,
) -> bool:
    state = await internal_state(engine)
    return (
        (running is None or state["num_running_reqs"] == running)
        and (waiting is None or state["num_waiting_reqs"] == waiting)
        and (held is None or state["num_held_reqs"] == held)
    )


async def test_abort_all_returns_every_one_of_8_long_requests_as_abort(local_engine):
    _, engine = local_engine
    results = []

    async def run(i: int) -> None:
        results.append(await engine.generate([3 + i, 4, 5], LONG, rid=f"long-{i}"))

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(run, i)
        await wait_for(lambda: _state_is(engine, running=8))
        await engine.abort_all()
    assert len(results) == 8
    for result in results:
        assert result.finish_reason.type == "abort" and result.finish_reason.message == "Aborted"
        assert len(result.output_ids) == len(result.output_logprobs) < 1000
    assert sorted(r.rid for r in results) == sorted(f"long-{i}" for i in range(8))


async def test_an_abort_sent_during_a_pause_is_lost_on_the_server_and_resent_by_the_client(
    local_engine,
):
    server, engine = local_engine
    await engine.pause("abort")
    done = trio.Event()
    results = []

    async def run(rid: str) -> None:
        results.append(await engine.generate([1, 2, 3], {"max_new_tokens": 4}, rid=rid))
        done.set()

    # SGLang 0.5.23: a request held behind a pause is not known to the scheduler yet, so an
    # abort (by rid or all) misses it and it runs after the resume
    async with trio.open_nursery() as nursery, httpx.AsyncClient(base_url=server.url) as http:
        nursery.start_soon(run, "held")
        await wait_for(lambda: _state_is(engine, held=1))  # in front of the scheduler
        for body in ({"rid": "held"}, {"abort_all": True}):
            assert (await http.post("/abort_request", json=body)).status_code == 200
        await trio.sleep(0.2)
        assert not done.is_set()
        await engine.resume()
    assert results[0].finish_reason.type == "length" and len(results[0].output_ids) == 4

    # the client remembers aborts sent while it has the engine paused and sends them again
    # right after its resume, so an abandoned request does not run on
    await engine.pause("abort")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "queued")
        await wait_for(lambda: _state_is(engine, held=1))
        await engine.abort("queued")
        await engine.resume()
    assert results[1].finish_reason.type == "abort" and len(results[1].output_ids) < 4

    await engine.pause("abort")
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "released")
        await wait_for(lambda: _state_is(engine, held=1))
        assert not done.is_set()
        await engine.resume()
    assert results[2].finish_reason.type == "length" and len(results[2].output_ids) == 4


async def test_retracted_requests_resume_with_exact_logprobs(local_engine, tiny_hf_model):
    server, engine = local_engine
    results = []
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25]]

    async def run(prompt: list[int]) -> None:
        results.append(
            (
                prompt,
                await engine.generate(
                    prompt, {"max_new_tokens": 60, "temperature": 0.8, "ignore_eos": True}
                ),
            )
        )

    async def generated_some() -> bool:
        running = server.state.scheduler.running  # read-only peek at the in-process server
        return len(running) == 2 and all(len(s.output_ids) >= 5 for s in running)

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(run, prompt)
        await wait_for(generated_some)
        await engine.pause("retract")
        assert await _state_is(engine, running=0, waiting=2)
        await engine.resume()
    for prompt, result in results:
        assert result.num_retractions == 1 and len(result.output_ids) == 60
        reference = teacher_forced(tiny_hf_model, prompt, list(result.output_ids), 0.8)
        assert (
            max(abs(a - b) for a, b in zip(result.output_logprobs, reference, strict=True)) <= 1e-4
        )


async def test_weight_update_changes_outputs_and_updating_back_restores_them_exactly(
    local_engine, tiny_model_dir, tiny_model_dir_seed1
):
    _, engine = local_engine
    prompt, params = [30, 31, 32, 33], {"max_new_tokens": 12, "temperature": 0}
    before = await engine.generate(prompt, params)

    message = await engine.update_weights_from_disk(str(tiny_model_dir_seed1), "v1")
    assert message == "Succeeded to update model weights. Weight version updated to v1."
    info = await engine.model_info()
    assert (info.model_path, info.weight_version) == (str(tiny_model_dir_seed1), "v1")
    changed = await engine.generate(prompt, params)
    assert changed.weight_version == "v1" and changed.output_logprobs != before.output_logprobs

    await engine.update_weights_from_disk(str(tiny_model_dir), "v2")
    restored = await engine.generate(prompt, params)
    assert restored.output_ids == before.output_ids
    assert restored.output_logprobs == before.output_logprobs  # bit-for-bit
    assert restored.weight_version == "v2"


async def test_failed_weight_updates_answer_400_and_keep_weights_path_and_version(
    local_engine, tiny_model_dir, tmp_path
):
    server, engine = local_engine
    prompt, params = [30, 31, 32, 33], {"max_new_tokens": 8, "temperature": 0}
    before = await engine.generate(prompt, params)

    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(tiny_model_dir, wrong_shape)
    tensors = load_file(wrong_shape / "model.safetensors")
    name = next(n for n in tensors if n.endswith("mlp.up_proj.weight"))
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, wrong_shape / "model.safetensors")

    async with httpx.AsyncClient(base_url=server.url) as http:
        for path, fragment in (
            (tmp_path / "missing", "Failed to get weights iterator:"),
            (wrong_shape, "Failed to update weights: shape mismatch"),
        ):
            response = await http.post(
                "/update_weights_from_disk", json={"model_path": str(path), "weight_version": "bad"}
            )
            assert response.status_code == 400
            body = response.json()
            assert (
                body["success"] is False
                and fragment in body["message"]
                and body["num_paused_requests"] == 0
            )
        assert "Rolling back to original weights." in body["message"]
    with pytest.raises(EngineError) as info:
        await engine.update_weights_from_disk(str(tmp_path / "missing"), "bad")
    assert info.value.status == 400 and "Failed to get weights iterator" in str(info.value)

    model = await engine.model_info()
    assert (model.model_path, model.weight_version) == (str(tiny_model_dir), "default")
    after = await engine.generate(prompt, params)  # its prefix now comes from the cache
    assert after.output_ids == before.output_ids
    assert after.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-5)


async def test_weight_update_waits_for_in_flight_requests_unless_told_to_abort_them(
    local_engine, tiny_model_dir_seed1
):
    server, engine = local_engine
    order: list[str] = []

    async def generate(rid: str, max_new: int) -> None:
        result = await engine.generate(
            [5, 6], {"max_new_tokens": max_new, "ignore_eos": True}, rid=rid
        )
        order.append(
            f"{rid}:{result.finish_reason.type}:{','.join(s.version for s in result.weight_versions)}"
        )

    async def update(version: str, abort_all_requests: bool) -> None:
        await engine.update_weights_from_disk(
            str(tiny_model_dir_seed1), version, abort_all_requests=abort_all_requests
        )
        order.append(f"update:{version}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate, "a", 150)
        await wait_for(lambda: _state_is(engine, running=1))
        nursery.start_soon(update, "v1", False)
    assert order == ["a:length:default", "update:v1"]  # the reader finished first, on old weights

    order.clear()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate, "b", 1000)
        # a first token must exist before the abort, or the result carries no version span
        await wait_for(lambda: _generated(server, 1))
        nursery.start_soon(update, "v2", True)
    assert order[0] == "b:abort:v1" and order[1] == "update:v2"


async def test_in_place_pause_keeps_requests_and_records_weight_version_spans(
    local_engine, tiny_model_dir_seed1
):
    server, engine = local_engine
    results = []

    async def run() -> None:
        results.append(await engine.generate([8, 9], {"max_new_tokens": 80, "ignore_eos": True}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await wait_for(lambda: _generated(server, 5))
        await engine.pause("in_place")
        await engine.update_weights_from_disk(  # paused: runs at once; requests stay, no flush
            str(tiny_model_dir_seed1), "v1", flush_cache=False
        )
        await engine.resume()
    (result,) = results
    assert result.finish_reason.type == "length" and len(result.output_ids) == 80
    assert [s.version for s in result.weight_versions] == ["default", "v1"]
    assert result.weight_versions[0].end == result.weight_versions[1].start
    assert result.weight_versions[1].end == 80 and result.weight_version == "v1"


async def _generated(server, count: int) -> bool:
    running = server.state.scheduler.running
    return bool(running) and len(running[0].output_ids) >= count


async def test_update_weight_version_and_flush_cache(local_engine):
    server, engine = local_engine
    await engine.update_weight_version("v9")
    assert (await engine.model_info()).weight_version == "v9"
    assert (await engine.generate([1, 2], {"max_new_tokens": 2})).weight_version == "v9"
    async with httpx.AsyncClient(base_url=server.url) as http:
        flushed = await http.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
        # SGLang 0.5.23: requests sent during a pause wait in front of the scheduler, so an
        # "abort" pause can flush; requests kept in place ("in_place") make the flush fail
        await engine.pause("abort")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.generate, [1, 2], {"max_new_tokens": 2})
            await wait_for(lambda: _state_is(engine, held=1))
            assert (await http.post("/flush_cache")).status_code == 200
            await engine.resume()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.generate, [1, 2], {"max_new_tokens": 500, "ignore_eos": True})
            await wait_for(lambda: _state_is(engine, running=1))
            await engine.pause("in_place")
            refused = await http.post("/flush_cache")
            assert refused.status_code == 400 and refused.text.startswith("Cache not flushed.")
            await engine.resume()
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            response = await http.post(path, json={})
            assert response.status_code == 200 and response.json() is None


def _sse(payload: bytes) -> list[object]:
    lines = [line for line in payload.decode().split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


async def test_stream_chunks_build_up_to_the_non_stream_result(local_engine):
    server, _ = local_engine
    body = {
        "input_ids": [7, 8, 9],
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
        "return_logprob": True,
    }
    async with httpx.AsyncClient(base_url=server.url) as http:
        await http.post("/generate", json=body)  # both below then reuse the same cached prefix
        whole = (await http.post("/generate", json=body)).json()
        response = await http.post("/generate", json={**body, "stream": True})
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(response.content)
        batch_chunks = _sse(
            (
                await http.post(
                    "/generate", json={**body, "input_ids": [[7, 8, 9], [1, 2]], "stream": True}
                )
            ).content
        )
    assert len(chunks) >= 2
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    for a, b in itertools.pairwise(chunks):  # cumulative: each chunk extends the last
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    final = chunks[-1]
    assert final["output_ids"] == whole["output_ids"] and final["text"] == whole["text"]
    assert (
        final["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    )
    assert final["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert {c["index"] for c in batch_chunks} == {0, 1}


async def test_incremental_stream_concatenation_equals_the_non_stream_result(tiny_model_dir):
    body = {
        "input_ids": [7, 8, 9],
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
        "return_logprob": True,
    }
    async with (
        open_local_engine(
            tiny_model_dir, num_threads=1, incremental_streaming_output=True
        ) as server,
        httpx.AsyncClient(base_url=server.url) as http,
    ):
        await http.post("/generate", json=body)  # both below then reuse the same cached prefix
        whole = (await http.post("/generate", json=body)).json()
        chunks = _sse((await http.post("/generate", json={**body, "stream": True})).content)
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    deltas = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert deltas == whole["meta_info"]["output_token_logprobs"]


async def test_openai_client_completions_and_chat_with_logprobs(local_engine):
    from openai import AsyncOpenAI

    server, engine = local_engine
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    assert model == str(server.config.model_path)

    completion = await client.completions.create(
        model=model, prompt="12+34=", max_tokens=6, temperature=0, logprobs=2
    )
    choice = completion.choices[0]
    assert completion.usage.completion_tokens == len(choice.logprobs.token_logprobs) == 6
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)
    assert choice.finish_reason == "length"
    native = await engine.generate(
        server.state.encode("12+34="), {"max_new_tokens": 6, "temperature": 0}
    )  # same tokens and logprobs as the native route
    assert choice.logprobs.token_logprobs == list(native.output_logprobs)

    messages = [{"role": "user", "content": "What is 2+3?"}]
    chat = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(
        len(c.top_logprobs) == 2 for c in content
    )
    assert content[0].top_logprobs[0].logprob == content[0].logprob  # greedy: the top-1 was sampled

    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    await client.close()


async def test_openai_streaming_completions_carry_the_logprobs_of_each_chunk(local_engine):
    from openai import AsyncOpenAI

    server, _ = local_engine
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = server.state.served_model_name
    args = {"model": model, "prompt": "12+34=", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    # a first request fills the prefix cache: the two compared below then both reuse it (a
    # cached and a fresh prefill can differ in the last float bit, e.g. 5e-7 with transformers
    # 5.25; that is the cache's rounding, not the stream's)
    await client.completions.create(**args)
    whole = (await client.completions.create(**args)).choices[0].logprobs
    stream = await client.completions.create(**args, stream=True)
    chunks = [chunk.choices[0] async for chunk in stream if chunk.choices]
    await client.close()
    assert all(c.logprobs is not None for c in chunks)
    assert [lp for c in chunks for lp in c.logprobs.token_logprobs] == whole.token_logprobs
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.tokens


async def test_openai_echo_returns_the_prompt_with_its_special_tokens(local_engine):
    from openai import AsyncOpenAI

    server, _ = local_engine
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    prompt = "<|im_start|>user\n12+34<|im_end|>\n<|im_start|>assistant\n"
    completion = await client.completions.create(
        model=server.state.served_model_name, prompt=prompt, max_tokens=3, temperature=0, echo=True
    )
    await client.close()
    assert completion.choices[0].text.startswith(prompt)


async def test_api_key_is_required_everywhere_except_health(tiny_model_dir):
    async with open_local_engine(tiny_model_dir, num_threads=1, api_key="sekret") as server:
        async with httpx.AsyncClient(base_url=server.url) as http:
            for path in ("/get_model_info", "/v1/models"):
                response = await http.get(path)
                assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}
            assert (await http.post("/generate", json={"input_ids": [1]})).status_code == 401
            wrong = await http.get("/get_model_info", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/health_generate")).status_code == 200
        async with SGLangEngine(server.url, api_key="sekret") as engine:
            assert (await engine.generate([1, 2], {"max_new_tokens": 2})).completion_tokens == 2


def test_local_engine_binds_loopback_by_default():
    from engines.local import LocalEngineConfig
    from engines.local.__main__ import build_parser

    assert LocalEngineConfig(model_path=str(Path("m"))).host == "127.0.0.1"
    assert build_parser().parse_args(["--model-path", "m"]).host == "127.0.0.1"
