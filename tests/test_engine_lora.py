"""LoRA on the local engine over loopback HTTP, against SGLang 0.5.23's behaviour.

Adapters are real peft adapters made from the tiny model (`get_peft_model`, `lora_B` perturbed
so they change the outputs, `save_pretrained`); the reference for every number is the same
adapter run by `PeftModel` in this process (tests/lora_helpers.py). SGLang behaviours checked,
with their source in the `sglang==0.5.23` wheel:
- `/load_lora_adapter`, `/unload_lora_adapter`: 200/400 with `{"success", "error_message",
  "loaded_adapters"}` (`srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`);
  duplicate name and bad path refused with the old adapters kept and listed
  (`srt/lora/lora_manager.py`); unknown name on unload: "does not exist", `loaded_adapters`
  null (`srt/lora/lora_registry.py::unregister`); rank above `--max-lora-rank` refused
  (`srt/lora/mem_pool.py::can_support`); LoRA off refused (`tokenizer_control_mixin.py`).
- `lora_path` on `/generate`: one name or one per prompt; a name never loaded → 400 "Got LoRA
  adapter that has never been loaded"; a name unloaded or evicted since is loaded again
  implicitly (`srt/managers/tokenizer_manager.py::_resolve_lora_path`); `--max-loaded-loras`
  evicts the least recently used (`tokenizer_control_mixin.py::load_lora_adapter`);
  `--max-loras-per-batch` bounds the adapters running together, base included.
- `/v1/*`: `model="<base>:<adapter>"` or the `lora_path` field picks the adapter; a plain
  `model="<adapter>"` is the base model (`srt/entrypoints/openai/serving_base.py`);
  `/v1/models` lists adapters with `parent` (`http_server.py::available_models`).
- `/update_weights_from_disk` replaces the base only; loaded adapters stay and apply on top
  (`model_runner_components/weight_updater.py` reloads the base model's weights only).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import trio
from lora_helpers import (  # noqa: F401  (fixtures)
    GREEDY,
    LORA,
    PROMPTS,
    adapters_fixture,
    assert_matches,
    greedy,
    loaded_on,
    lora_engine_fixture,
    make_adapter,
    misfit_adapter,
    peft_reference,
    post,
    references_fixture,
)

from engines import EngineError, LoraAdapterError, SGLangEngine
from engines.local import open_local_engine


async def test_adapter_generation_equals_peft_and_base_requests_are_unchanged(
    lora_engine, adapters, references
):
    server, engine = lora_engine
    loaded = await engine.load_lora_adapter("a1", adapters["a1"])
    assert loaded == {"a1": str(adapters["a1"])}
    for i, prompt in enumerate(PROMPTS):
        assert_matches(await engine.generate(prompt, GREEDY, lora_path="a1"), references["a1", i])
        assert_matches(await engine.generate(prompt, GREEDY), references[None, i])  # base
    assert references["a1", 0][0] != references[None, 0][0]  # the adapter changes the tokens
    # raw body: SGLang's answer shape
    response = await post(server.url, "/load_lora_adapter",
                          {"lora_name": "a2", "lora_path": str(adapters["a2"])})  # fmt: skip
    assert response.status_code == 200
    assert response.json() == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"a1": str(adapters["a1"]), "a2": str(adapters["a2"])},
    }


async def test_base_and_two_adapters_share_a_batch_and_each_row_gets_its_own_output(
    lora_engine, adapters, references
):
    _, engine = lora_engine
    for name in ("a1", "a2"):
        await engine.load_lora_adapter(name, adapters[name])
    rows = [(None, 0), ("a1", 0), ("a2", 0), ("a1", 1), (None, 2), ("a2", 2)]
    # one /generate batch, lora_path per prompt (identical prompts with different adapters too)
    results = await engine.generate_batch(
        [PROMPTS[i] for _, i in rows], GREEDY, lora_path=[name for name, _ in rows]
    )
    for (name, i), result in zip(rows, results, strict=True):
        assert_matches(result, references[name, i])

    # concurrent requests join the running batch mid-decode: prefill and decode are mixed
    concurrent: dict[int, object] = {}

    async def one(k: int, name: str | None, i: int) -> None:
        await trio.sleep(0.02 * k)
        concurrent[k] = await engine.generate(PROMPTS[i], GREEDY, lora_path=name)

    async with trio.open_nursery() as nursery:
        for k, (name, i) in enumerate(rows * 2):
            nursery.start_soon(one, k, name, i)
    for k, (name, i) in enumerate(rows * 2):
        assert_matches(concurrent[k], references[name, i])


async def test_refusals_follow_sglang_and_keep_the_loaded_adapters(
    lora_engine, adapters, references, tmp_path
):
    server, engine = lora_engine
    await engine.load_lora_adapter("a1", adapters["a1"])
    kept = {"a1": str(adapters["a1"])}

    response = await post(server.url, "/load_lora_adapter",
                          {"lora_name": "a1", "lora_path": str(adapters["a2"])})  # fmt: skip
    assert response.status_code == 400
    assert response.json() == {
        "success": False,
        "error_message": "Failed to load LoRA adapter a1 because it is already loaded",
        "loaded_adapters": kept,
    }
    assert_matches(await engine.generate(PROMPTS[0], GREEDY, lora_path="a1"), references["a1", 0])

    missing = tmp_path / "no_such_adapter"
    with pytest.raises(LoraAdapterError) as info:
        await engine.load_lora_adapter("bad", missing)
    assert info.value.status == 400 and str(missing / "adapter_config.json") in str(info.value)
    assert info.value.loaded_adapters == kept

    with pytest.raises(LoraAdapterError, match="with rank 16 is incompatible") as info:
        await engine.load_lora_adapter("big", adapters["rank16"])
    assert info.value.loaded_adapters == kept

    # tensors that do not fit the model (as from another base model): refused, nothing kept
    with pytest.raises(LoraAdapterError, match="size mismatch") as info:
        await engine.load_lora_adapter("misfit", misfit_adapter(adapters["a2"], tmp_path / "m"))
    assert info.value.loaded_adapters == kept
    assert_matches(await engine.generate(PROMPTS[2], GREEDY, lora_path="a1"), references["a1", 2])
    assert_matches(await engine.generate(PROMPTS[2], GREEDY), references[None, 2])

    response = await post(server.url, "/unload_lora_adapter", {"lora_name": "nope"})
    assert response.status_code == 400
    assert response.json() == {
        "success": False,
        "error_message": "LoRA with name nope does not exist. Loaded LoRAs: odict_keys(['a1'])",
        "loaded_adapters": None,
    }

    response = await post(server.url, "/generate",
                          {"input_ids": PROMPTS[0], "lora_path": "nope"})  # fmt: skip
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "Got LoRA adapter that has never been loaded: nope\nAll loaded adapters: dict_keys(['a1'])."
    )
    response = await post(server.url, "/load_lora_adapter", {"lora_name": "x"})
    assert response.status_code == 400 and "lora_path" in response.json()["message"]

    # unloaded, then asked for: SGLang loads it again from the path it had
    assert await engine.unload_lora_adapter("a1") == {}
    assert_matches(await engine.generate(PROMPTS[1], GREEDY, lora_path="a1"), references["a1", 1])
    assert (await engine.server_info())["enable_lora"] is True


async def test_lora_off_refuses_loads_and_adapter_requests(local_engine, adapters):
    server, engine = local_engine
    response = await post(server.url, "/load_lora_adapter",
                          {"lora_name": "a1", "lora_path": str(adapters["a1"])})  # fmt: skip
    assert (response.status_code, response.json()) == (400, {
        "success": False,
        "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
        "loaded_adapters": None,
    })  # fmt: skip
    with pytest.raises(EngineError, match="LoRA adapter 'a1' was requested, but LoRA is not"):
        await engine.generate(PROMPTS[0], GREEDY, lora_path="a1")


async def test_openai_routes_pick_the_adapter_from_model_as_sglang_does(
    lora_engine, adapters, references, tiny_tokenizer
):
    server, engine = lora_engine
    await engine.load_lora_adapter("a1", adapters["a1"])
    served = server.state.served_model_name
    body = {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True}

    async def completion(**extra) -> str:
        response = await post(server.url, "/v1/completions", {**body, **extra})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    # the completions route skips special tokens in its text, as SGLang's does by default
    adapter_text = tiny_tokenizer.decode(references["a1", 0][0], skip_special_tokens=True)
    base_text = tiny_tokenizer.decode(references[None, 0][0], skip_special_tokens=True)
    assert await completion(model=f"{served}:a1") == adapter_text
    assert await completion(model="anything:a1") == adapter_text
    assert await completion(model=served, lora_path="a1") == adapter_text
    assert await completion(model="a1") == base_text  # no colon: the base model (SGLang)
    response = await post(server.url, "/v1/completions", {**body, "model": f"{served}:nope"})
    assert response.status_code == 400 and "never been loaded: nope" in response.json()["message"]

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    answers = []
    for extra in ({"model": f"{served}:a1"}, {"model": served, "lora_path": "a1"}):
        response = await post(server.url, "/v1/chat/completions", {**chat, **extra})
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]

    async with httpx.AsyncClient(base_url=server.url) as http:
        cards = (await http.get("/v1/models")).json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (served, None, served),
        ("a1", served, str(adapters["a1"])),
    ]


async def test_base_weight_update_keeps_adapters_applied_on_the_new_base(
    lora_engine, adapters, tiny_model_dir_seed1
):
    _, engine = lora_engine
    await engine.load_lora_adapter("a1", adapters["a1"])
    await engine.update_weights_from_disk(tiny_model_dir_seed1, "w1")
    reference = peft_reference(tiny_model_dir_seed1, adapters["a1"])
    result = await engine.generate(PROMPTS[0], GREEDY, lora_path="a1")
    assert_matches(result, greedy(reference, PROMPTS[0], GREEDY["max_new_tokens"]))
    assert result.weight_version == "w1"
    base = await engine.generate(PROMPTS[0], GREEDY)
    assert_matches(base, greedy(peft_reference(tiny_model_dir_seed1, None), PROMPTS[0], 10))


async def test_an_adapter_reloaded_under_the_same_name_reuses_no_kv_of_the_old_one(
    lora_engine, adapters, references
):
    _, engine = lora_engine
    await engine.load_lora_adapter("x", adapters["a1"])
    assert_matches(await engine.generate(PROMPTS[0], GREEDY, lora_path="x"), references["a1", 0])
    # its finished row is still in the batch (it leaves at the next step): written back there
    await engine.unload_lora_adapter("x")
    await engine.load_lora_adapter("x", adapters["a2"])
    assert_matches(await engine.generate(PROMPTS[0], GREEDY, lora_path="x"), references["a2", 0])


async def test_max_loras_per_batch_bounds_the_adapters_running_together(
    tiny_model_dir, adapters, references
):
    """`--max-loras-per-batch 2` (the base model counts): a third adapter waits its turn."""
    async with (
        open_local_engine(tiny_model_dir, num_threads=1, **{**LORA, "max_loras_per_batch": 2})
        as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):  # fmt: skip
        for name in ("a1", "a2"):
            await engine.load_lora_adapter(name, adapters[name])
        scheduler = server.state.scheduler
        seen: set[int] = set()
        results: dict[int, object] = {}
        rows = [(None, 0), ("a1", 1), ("a2", 2), ("a1", 0), ("a2", 1), (None, 2)]

        async def one(k: int, name: str | None, i: int) -> None:
            results[k] = await engine.generate(PROMPTS[i], GREEDY, lora_path=name)

        async with trio.open_nursery() as nursery:
            for k, (name, i) in enumerate(rows):
                nursery.start_soon(one, k, name, i)

            async def watch() -> None:
                while True:
                    seen.add(len({s.item.lora_name for s in scheduler.running if not s.finished}))
                    await trio.sleep(0)

            nursery.start_soon(watch)
            while len(results) < len(rows):
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert max(seen) == 2
        for k, (name, i) in enumerate(rows):
            assert_matches(results[k], references[name, i])


async def test_max_loaded_loras_evicts_the_least_recently_used_and_reloads_it_on_demand(
    tiny_model_dir, adapters, references
):
    options = {**LORA, "max_loras_per_batch": 2, "max_loaded_loras": 2}
    async with (
        open_local_engine(tiny_model_dir, num_threads=1, **options) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):
        await engine.load_lora_adapter("a1", adapters["a1"])
        await engine.load_lora_adapter("a2", adapters["a2"])
        await engine.generate(PROMPTS[0], GREEDY, lora_path="a1")  # a2 is now the LRU one
        loaded = await engine.load_lora_adapter("b1", adapters["a1"])
        assert loaded == {"a1": str(adapters["a1"]), "b1": str(adapters["a1"])}
        assert_matches(await engine.generate(PROMPTS[2], GREEDY, lora_path="a2"),
                       references["a2", 2])  # fmt: skip
        assert set(await loaded_on(server.url)) == {"b1", "a2"}  # a1 was the LRU one then
        # streaming takes the same adapter path
        body = {"input_ids": PROMPTS[1], "sampling_params": GREEDY, "lora_path": "b1",
                "stream": True}  # fmt: skip
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            response = await http.post("/generate", json=body)
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["output_ids"] == references["a1", 1][0]


async def test_a_failed_first_load_leaves_the_model_as_it_was(
    lora_engine, adapters, references, tmp_path
):
    """The first adapter wraps the model in peft; if its weights do not fit, the wrapper holds
    nothing and the next load works as if it were the first."""
    _, engine = lora_engine
    with pytest.raises(LoraAdapterError, match="size mismatch") as info:
        await engine.load_lora_adapter("misfit", misfit_adapter(adapters["a1"], tmp_path / "m"))
    assert info.value.loaded_adapters == {}
    assert_matches(await engine.generate(PROMPTS[0], GREEDY), references[None, 0])
    await engine.load_lora_adapter("a2", adapters["a2"])
    assert_matches(await engine.generate(PROMPTS[0], GREEDY, lora_path="a2"), references["a2", 0])
    assert_matches(await engine.generate(PROMPTS[1], GREEDY), references[None, 1])


async def test_an_adapter_named_during_a_pause_is_resolved_when_the_pause_ends(
    lora_engine, adapters, references
):
    """SGLang waits for the pause before it resolves adapter names, so a request sent while a
    weight sync loads the adapter it names runs on that adapter (and one naming an unknown
    adapter fails only then)."""
    server, engine = lora_engine
    await engine.pause("in_place")
    results: dict[str, object] = {}

    async def send(name: str) -> None:
        try:
            results[name] = await engine.generate(PROMPTS[0], GREEDY, lora_path=name)
        except EngineError as exc:
            results[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, "a1")
        nursery.start_soon(send, "nope")
        with trio.fail_after(10):
            while len(server.state.scheduler.held) < 2:
                await trio.sleep(0.01)
        await engine.load_lora_adapter("a1", adapters["a1"])
        await engine.resume()
    assert_matches(results["a1"], references["a1", 0])
    assert isinstance(results["nope"], EngineError) and results["nope"].status == 400
    assert "never been loaded: nope" in str(results["nope"])


def test_an_adapter_is_the_same_whatever_ran_before_it(tiny_model_dir, tmp_path):
    """make_adapter's lora_A (peft draws it from the global generator) depends only on its seed:
    under xdist the tests that ran before it in a process differ from run to run."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    first = load_file(
        make_adapter(tiny_model_dir, tmp_path / "x", seed=1) / "adapter_model.safetensors"
    )
    torch.manual_seed(123)
    torch.rand(7)
    second = load_file(
        make_adapter(tiny_model_dir, tmp_path / "y", seed=1) / "adapter_model.safetensors"
    )
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
