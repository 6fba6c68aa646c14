"""The local engine's distributed refit routes answer misuse as SGLang 0.5.23 does (400,
`success: false`, SGLang's message), over real loopback HTTP; no weights change."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio
from lora_helpers import greedy, peft_reference

from engines import SGLangEngine, find_free_port
from engines.local import open_local_engine
from engines.local.refit_session import ALREADY_OPEN, RefitSession


async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(path, json=body)
    return response.status_code, response.json()


UPDATE = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[4, 4]]}


async def test_refit_routes_refuse_updates_outside_a_session_or_group_as_sglang_does(
    local_engine,
):
    server, engine = local_engine
    url = server.url
    before = (await engine.model_info()).weight_version

    status, body = await post(url, "/update_weights_from_distributed", UPDATE)
    assert (status, body["success"]) == (400, False)
    assert body["message"] == ("update_weights_from_distributed must run between "
                               "begin_weight_update() and end_weight_update()")  # fmt: skip

    assert await post(url, "/begin_weight_update", {}) == (200, {"success": True,
                                                                 "message": "Success"})  # fmt: skip
    status, body = await post(url, "/begin_weight_update", {})
    assert status == 400 and "already open" in body["message"]

    status, body = await post(url, "/update_weights_from_distributed",
                              {**UPDATE, "group_name": "no-such-group"})  # fmt: skip
    assert (status, body["success"]) == (400, False)
    assert body["message"] == ("Failed to receive weights: Group no-such-group not in []. "
                               "Please call `init_weights_update_group` first.")  # fmt: skip

    # a refused bucket abandons the session (all or nothing): its end says so, loads nothing
    status, body = await post(url, "/end_weight_update", {})
    assert status == 400 and "abandoned" in body["message"]
    status, body = await post(url, "/end_weight_update", {})
    assert status == 400 and body["message"].startswith("no weight-update session is open")
    assert (await post(url, "/begin_weight_update", {}))[0] == 200
    assert await post(url, "/end_weight_update", {}) == (200, {"success": True,
                                                               "message": "Success"})  # fmt: skip

    status, body = await post(url, "/destroy_weights_update_group", {"group_name": "nope"})
    assert (status, body) == (400, {"success": False,
                                    "message": "The group to be destroyed does not exist."})  # fmt: skip
    assert (await engine.model_info()).weight_version == before


async def test_refit_routes_reject_malformed_bodies_naming_the_field(local_engine):
    server, _ = local_engine
    status, body = await post(server.url, "/update_weights_from_distributed",
                              {**UPDATE, "shapes": [[4, -1]]})  # fmt: skip
    assert status == 400 and "shapes[0]" in body["message"]
    status, body = await post(server.url, "/update_weights_from_distributed",
                              {**UPDATE, "dtypes": ["float32", "float32"]})  # fmt: skip
    assert status == 400 and "lengths differ" in body["message"]
    status, body = await post(server.url, "/init_weights_update_group",
                              {"master_address": "127.0.0.1", "master_port": "x",
                               "rank_offset": 1, "world_size": 2})  # fmt: skip
    assert status == 400 and "master_port" in body["message"]


async def test_init_group_with_nccl_on_a_cpu_engine_answers_sglangs_failure(local_engine):
    server, _ = local_engine
    status, body = await post(server.url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": find_free_port(), "rank_offset": 1,
        "world_size": 2, "group_name": "g", "backend": "nccl"})  # fmt: skip
    assert (status, body["success"]) == (400, False)
    assert body["message"].startswith("Failed to initialize custom process group:")


async def test_a_sender_killed_mid_broadcast_leaves_old_weights_and_the_next_push_succeeds(
    tiny_model_dir, tiny_model_dir_seed1, tiny_hf_model, warm_python
):
    sender = Path(__file__).parent / "refit_sender.py"
    prompt, greedy6 = [4, 5, 6, 7], {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def serves(engine: SGLangEngine, model, version: str) -> None:
        assert (await engine.model_info()).weight_version == version
        tokens, logprobs = greedy(model, prompt, 6)
        result = await engine.generate(prompt, greedy6)
        assert list(result.output_ids) == tokens
        assert max(abs(a - b) for a, b in zip(result.output_logprobs, logprobs, strict=True)) < 1e-5

    async with (
        open_local_engine(tiny_model_dir, num_threads=1, weight_group_timeout_s=20) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):
        before = (await engine.model_info()).weight_version

        def push(*extra: str):
            argv = [sender, server.url, tiny_model_dir_seed1, "v1", *extra]
            return warm_python.run(argv, cwd=sender.parent.parent, timeout=120)

        killed = await trio.to_thread.run_sync(push, "2")  # dies with 2 buckets sent
        assert killed.returncode == 9, killed.stderr[-3000:]
        await serves(engine, tiny_hf_model, before)  # all or nothing: nothing, label true
        # a trainer killed right after its begin leaves a session open with no receive under
        # way: the next push (a restarted trainer, a new group) is not refused because of it
        assert (await post(server.url, "/begin_weight_update", {}))[0] == 200
        pushed = await trio.to_thread.run_sync(push)
        assert pushed.returncode == 0, pushed.stderr[-3000:]
        assert json.loads(pushed.stdout) == {}
        await serves(engine, peft_reference(tiny_model_dir_seed1, None), "v1")


async def test_a_session_idle_past_the_groups_deadline_gives_way_to_the_next_begin(
    autojump_clock,
):
    session = RefitSession(timeout_s=20)
    assert session.begin() is None
    async with session.receiving("g") as ticket:
        session.stage(ticket, {"w": 1}, "v1", flush=False, abort_all=False)
    assert session.begin() == ALREADY_OPEN  # its sender may still be alive
    await trio.sleep(21)
    assert session.begin() is None  # gone: dropped, nothing of it staged in the new one
    assert session.finish() == ({}, None, False, False)
