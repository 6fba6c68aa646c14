"""The local engine's distributed refit routes answer misuse as SGLang 0.5.23 does (400,
`success: false`, SGLang's message), over real loopback HTTP; no weights change."""

from __future__ import annotations

import httpx

from engines import find_free_port


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

    assert (await post(url, "/end_weight_update", {}))[0] == 200
    status, body = await post(url, "/end_weight_update", {})
    assert status == 400 and body["message"].startswith("no weight-update session is open")

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
