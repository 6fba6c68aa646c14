"""LoRA on the local engine over loopback HTTP, against SGLang 0.5.23's behaviour, and the
client side (`load_lora_adapter`, `active_lora`, `sync_lora_to_engines`, pool rejoin).

Adapters are real peft adapters made from the tiny model (`get_peft_model`, `lora_B` perturbed
so they change the outputs, `save_pretrained`); the reference for every number is the same
adapter run by `PeftModel` in this process. SGLang behaviours checked, with their source in the
`sglang==0.5.23` wheel:
- `/load_lora_adapter`, `/unload_lora_adapter`: 200/400 with `{"success", "error_message",
  "loaded_adapters"}` (`srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`);
  duplicate name and bad path refused with the old adapters kept and listed
  (`srt/lora/lora_manager.py`); unknown name on unload: "does not exist", `loaded_adapters`
  null (`srt/lora/lora_registry.py::unregister`); rank above `--max-lora-rank` refused
  (`srt/lora/mem_pool.py::can_support`); LoRA off refused (`tokenizer_control_mixin.py`).
- `lora_path` on `/generate`: one name or one per prompt; a name never loaded → 400 "Got LoRA
  adapter that has never been loaded"; a name unloaded since is loaded again implicitly
  (`srt/managers/tokenizer_manager.py::_resolve_lora_path`).
- `/v1/*`: `model="<base>:<adapter>"` or the `lora_path` field picks the adapter; a plain
  `model="<adapter>"` is the base model (`srt/entrypoints/openai/serving_base.py`);
  `/v1/models` lists adapters with `parent` (`http_server.py::available_models`).
- `/update_weights_from_disk` replaces the base only; loaded adapters stay and apply on top
  (`model_runner_components/weight_updater.py` reloads the base model's weights only).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
import trio

from engines import (
    EngineError,
    EnginePool,
    LoraAdapterError,
    LoraLaunch,
    SGLangEngine,
    WeightSyncError,
    find_free_port,
    lora_version_name,
    sync_lora_to_engines,
)
from engines.local import open_local_engine

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [70, 71]]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
LORA = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ("all",)}


def _one_thread():
    torch.set_num_threads(1)


def make_adapter(base_dir: Path, out: Path, seed: int, rank: int = 4) -> Path:
    """A peft LoRA adapter of the tiny model whose lora_B is random (so it changes outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        "a1": make_adapter(tiny_model_dir, root / "a1", seed=1),
        "a2": make_adapter(tiny_model_dir, root / "a2", seed=2),
        "rank16": make_adapter(tiny_model_dir, root / "rank16", seed=3, rank=16),
    }


def peft_reference(base_dir: Path, adapter: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, one full forward pass per token (no cache)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            token = int(row.argmax())
            ids.append(token)
            logprobs.append(float(row[token]))
    return ids[len(prompt) :], logprobs


@pytest.fixture(scope="session")
def references(tiny_model_dir, adapters):
    """(tokens, logprobs) per (adapter or None, prompt index), from PeftModel in this process."""
    _one_thread()
    out = {}
    for name in (None, "a1", "a2"):
        model = peft_reference(tiny_model_dir, adapters[name] if name else None)
        for i, prompt in enumerate(PROMPTS):
            out[name, i] = greedy(model, prompt, GREEDY["max_new_tokens"])
    return out


def assert_matches(result, reference) -> None:
    tokens, logprobs = reference
    assert list(result.output_ids) == tokens
    assert max(abs(a - b) for a, b in zip(result.output_logprobs, logprobs, strict=True)) < 1e-5


@pytest.fixture
async def lora_engine(tiny_model_dir):
    async with (
        open_local_engine(tiny_model_dir, num_threads=1, **LORA) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):
        yield server, engine


async def post(url: str, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.post(path, json=body)


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

    adapter_text = tiny_tokenizer.decode(references["a1", 0][0])
    base_text = tiny_tokenizer.decode(references[None, 0][0])
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
    _one_thread()
    reference = peft_reference(tiny_model_dir_seed1, adapters["a1"])
    result = await engine.generate(PROMPTS[0], GREEDY, lora_path="a1")
    assert_matches(result, greedy(reference, PROMPTS[0], GREEDY["max_new_tokens"]))
    assert result.weight_version == "w1"
    base = await engine.generate(PROMPTS[0], GREEDY)
    assert_matches(base, greedy(peft_reference(tiny_model_dir_seed1, None), PROMPTS[0], 10))


async def run_engine(model_dir, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A LoRA-enabled local engine on `port` until this task is cancelled (= it dies)."""
    async with open_local_engine(model_dir, port=port, num_threads=1, **LORA) as server:
        task_status.started(server)
        await trio.sleep_forever()


async def loaded_on(url: str) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=url) as http:
        cards = (await http.get("/v1/models")).json()["data"]
    return {c["id"]: c["root"] for c in cards if c["parent"] is not None}


async def test_sync_lora_keeps_the_newest_and_generation_uses_the_active_one(
    tiny_model_dir, adapters, references
):
    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        for port in ports:
            await nursery.start(run_engine, tiny_model_dir, port)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        async with SGLangEngine(urls[0], max_retries=0) as a, SGLangEngine(
            urls[1], max_retries=0
        ) as b:  # fmt: skip
            pushes = ["a1", "a2", "a1", "a2"]  # the adapter directory of each version
            for version, which in enumerate(pushes, start=1):
                name = lora_version_name("policy", version)
                duration = await sync_lora_to_engines(
                    [a, b], adapters[which], name, f"v{version}", keep=2
                )
                assert duration > 0
                for engine, url in ((a, urls[0]), (b, urls[1])):
                    assert engine.active_lora == name
                    assert (await engine.model_info()).weight_version == f"v{version}"
                    expected = [lora_version_name("policy", v) for v in (version - 1, version)]
                    assert sorted(await loaded_on(url)) == sorted(
                        n for n in expected if "v0" not in n
                    )
                    # no lora_path: the active adapter; explicit None: the base model
                    assert_matches(await engine.generate(PROMPTS[0], GREEDY), references[which, 0])
                    assert_matches(
                        await engine.generate(PROMPTS[0], GREEDY, lora_path=None),
                        references[None, 0],
                    )
            # a refused push names the engines and leaves the active adapter as it was
            with pytest.raises(WeightSyncError, match="adapter_config.json") as info:
                await sync_lora_to_engines(
                    [a, b], adapters["a1"].parent / "none", "policy-v9", "v9"
                )
            assert urls[0] in str(info.value) and urls[1] in str(info.value)
            assert a.active_lora == b.active_lora == "policy-v4"
        nursery.cancel_scope.cancel()


async def test_an_engine_down_during_a_lora_sync_gets_the_adapter_when_it_returns(
    tiny_model_dir, adapters, references
):
    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        await nursery.start(run_engine, tiny_model_dir, ports[0])
        doomed = trio.CancelScope()

        async def run_doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with doomed:
                await run_engine(tiny_model_dir, ports[1], task_status=task_status)

        await nursery.start(run_doomed)
        a = SGLangEngine(f"http://127.0.0.1:{ports[0]}", max_retries=0)
        b = SGLangEngine(f"http://127.0.0.1:{ports[1]}", max_retries=0)
        async with a, b, EnginePool([a, b], probe_interval_s=0.1) as pool:
            await sync_lora_to_engines([a, b], adapters["a1"], "policy-v1", "v1")
            doomed.cancel()
            await trio.sleep(0.2)
            await sync_lora_to_engines([a, b], adapters["a2"], "policy-v2", "v2")  # b is down
            assert pool.active_lora == "policy-v2"
            await nursery.start(run_engine, tiny_model_dir, ports[1])  # back, without adapters
            with trio.fail_after(30):
                while not pool.statistics().engines[1].healthy:
                    await trio.sleep(0.05)
            assert await loaded_on(b.url) == {"policy-v2": str(adapters["a2"])}
            assert (await b.model_info()).weight_version == "v2"
            for _ in range(4):
                assert_matches(await pool.generate(PROMPTS[2], GREEDY), references["a2", 2])
        nursery.cancel_scope.cancel()


def test_launch_flags_are_sglangs():
    assert LoraLaunch(8).args() == [
        "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
        "--max-loras-per-batch", "8",
    ]  # fmt: skip
    assert LoraLaunch(4, ["q_proj", "v_proj"], max_loras_per_batch=3).args()[4:7] == [
        "q_proj", "v_proj", "--max-loras-per-batch"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoraLaunch(0)
    assert lora_version_name("policy", 3) == "policy-v3"
    args = LoraLaunch(8, "all-linear").args()  # peft's spelling becomes SGLang's
    assert "all" in args and "all-linear" not in args


async def test_launch_engine_passes_the_lora_flags_to_the_local_engine(
    tiny_model_dir, adapters, references, tmp_path
):
    from engines import launch_engine

    lora = LoraLaunch(max_lora_rank=8, max_loras_per_batch=3)
    async with (
        launch_engine(kind="local", model_path=tiny_model_dir, log_path=tmp_path / "e.log",
                      lora=lora) as launched,
        SGLangEngine(launched.url, max_retries=0) as engine,
    ):  # fmt: skip
        info = await engine.server_info()
        assert (info["enable_lora"], info["max_lora_rank"], info["max_loras_per_batch"]) == (
            True, 8, 3,
        )  # fmt: skip
        assert info["lora_target_modules"] == ["all"]
        await engine.load_lora_adapter("a2", adapters["a2"])
        assert_matches(await engine.generate(PROMPTS[1], GREEDY, lora_path="a2"),
                       references["a2", 1])  # fmt: skip
        with pytest.raises(LoraAdapterError, match="rank 16"):
            await engine.load_lora_adapter("big", adapters["rank16"])


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


async def test_the_router_sends_the_workers_active_adapter_through_the_gateway(
    tiny_model_dir, adapters, references
):
    from engines.router import RouterEngine
    from engines.testing.gateway import open_gateway

    async with trio.open_nursery() as nursery:
        workers = [await nursery.start(run_engine, tiny_model_dir, find_free_port())
                   for _ in range(2)]  # fmt: skip
        clients = [SGLangEngine(w.url, max_retries=0) for w in workers]
        async with (
            open_gateway([w.url for w in workers]) as (url, _),
            RouterEngine(SGLangEngine(url, max_retries=0), clients) as router,
            clients[0],
            clients[1],
        ):
            await sync_lora_to_engines(router.workers, adapters["a1"], "policy-v1", "v1")
            assert router.active_lora == "policy-v1"
            assert_matches(await router.generate(PROMPTS[0], GREEDY), references["a1", 0])
            batch = await router.generate_batch(
                [PROMPTS[1], PROMPTS[1]], GREEDY, lora_path=["policy-v1", None]
            )
            assert_matches(batch[0], references["a1", 1])
            assert_matches(batch[1], references[None, 1])
        nursery.cancel_scope.cancel()


async def test_a_request_to_an_engine_restarted_without_its_adapter_fails_over(
    tiny_model_dir, adapters, references
):
    """Before the prober notices a restart, the engine answers 400 "never been loaded" for the
    active adapter: the pool treats that as stale weights and retries on another engine."""
    ports = [find_free_port(), find_free_port()]
    async with trio.open_nursery() as nursery:
        await nursery.start(run_engine, tiny_model_dir, ports[0])
        doomed = trio.CancelScope()

        async def run_doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with doomed:
                await run_engine(tiny_model_dir, ports[1], task_status=task_status)

        await nursery.start(run_doomed)
        a = SGLangEngine(f"http://127.0.0.1:{ports[0]}", max_retries=0)
        b = SGLangEngine(f"http://127.0.0.1:{ports[1]}", max_retries=0)
        async with a, b, EnginePool([a, b], probe_interval_s=600) as pool:
            await sync_lora_to_engines([a, b], adapters["a1"], "policy-v1", "v1")
            doomed.cancel()
            await trio.sleep(0.2)
            await nursery.start(run_engine, tiny_model_dir, ports[1])  # back, no adapter
            for _ in range(4):
                assert_matches(await pool.generate(PROMPTS[0], GREEDY), references["a1", 0])
            stats = pool.statistics().engines
            assert stats[1].failures == {"stale weights": 1} and not stats[1].healthy
            assert stats[0].done == 4
        nursery.cancel_scope.cancel()


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
