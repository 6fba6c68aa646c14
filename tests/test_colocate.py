"""Colocated mode (issue 47 item 3): the local engine releases its weights' and KV memory for
real and takes it back (`/release_memory_occupation`, `/resume_memory_occupation`), and an RL
run that releases the engines while it trains computes what a run that does not computes.

The memory test uses a launched engine process: its resident memory is read from /proc.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import trio
from lora_helpers import greedy
from rl_helpers import rl_backend, run_loop
from test_push_faults import train_step
from test_rl_empty_batches import failing_first

from engines import EnginePool, SGLangEngine, launch_engine
from engines.local import open_local_engine
from engines.testing.fault_proxy import FaultPlan, FaultProxy
from rollouts.config import RolloutConfig, SamplingConfig
from training.loops.colocate import colocated_weights_dir, ranks_give_back
from training.loops.weight_push import push_weights
from training.rl.algorithms import reinforce
from training.rl_config import RLRunConfig

PROMPT = [4, 5, 6, 7]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def weight_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


async def test_a_released_engine_gives_its_weights_memory_back_and_serves_the_trainers_after_resume(
    tiny_model_dir, tmp_path
):
    backend = rl_backend(tiny_model_dir, tmp_path)
    with backend:
        async with (
            launch_engine(kind="local", model_path=tiny_model_dir,
                          log_path=tmp_path / "e.log") as launched,
            SGLangEngine(launched.url, max_retries=0) as engine,
            httpx.AsyncClient(base_url=launched.url, timeout=30) as http,
        ):  # fmt: skip
            await engine.generate(PROMPT, {"max_new_tokens": 4})  # warm: its KV and buffers
            before = rss_bytes(launched.pid)
            await engine.release_memory_occupation()
            released = rss_bytes(launched.pid)
            freed = before - released
            print(f"RSS {before / 2**20:.1f} MiB -> {released / 2**20:.1f} MiB after release "
                  f"(weights {weight_bytes(tiny_model_dir) / 2**20:.1f} MiB)")  # fmt: skip
            assert freed >= 0.8 * weight_bytes(tiny_model_dir)

            # released: requests and weight loads are refused, naming what to call
            refused = await http.post("/generate", json={"input_ids": PROMPT})
            assert refused.status_code == 400 and "/resume_memory_occupation" in refused.text
            version = await train_step(backend)
            export = await backend.export_weights(tmp_path / "w" / "v1")
            load = await http.post("/update_weights_from_disk", json={"model_path": str(export)})
            assert "resume_memory_occupation" in load.text and not load.json().get("success")
            assert (await http.get("/health_generate")).status_code == 503  # not a 500
            bad = await http.post("/release_memory_occupation", json={"tags": ["kv", "weights"]})
            assert bad.status_code == 400 and "unknown memory tags ['kv']" in bad.text

            await engine.resume_memory_occupation()  # untouched pages: resident once loaded
            refused = await http.post("/generate", json={"input_ids": PROMPT})
            assert refused.status_code == 400 and "load weights" in refused.text

            await push_weights(backend, [engine], tmp_path / "w")
            assert (await engine.model_info()).weight_version == version
            assert rss_bytes(launched.pid) - released >= 0.8 * weight_bytes(tiny_model_dir)
            tokens, logprobs = greedy(backend.model.eval(), PROMPT, 6)
            result = await engine.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0})
            assert list(result.output_ids) == tokens
            assert max(abs(a - b) for a, b in zip(result.output_logprobs, logprobs,
                                                  strict=True)) < 1e-5  # fmt: skip


async def test_an_engine_with_requests_in_flight_refuses_to_release_its_memory(tiny_model_dir):
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):  # fmt: skip
        refusals: list[httpx.Response] = []

        async def release_while_busy() -> None:
            # once the engine holds the generation, not after a fixed 0.05 s: on a loaded
            # machine the request may not be there yet, and the release of an idle engine works
            with trio.fail_after(60):
                while not server.state.scheduler.busy:
                    await trio.sleep(0.005)
            refusals.append(await http.post("/release_memory_occupation", json={}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(release_while_busy)
            answer = await http.post("/generate", json={
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200,
                                                         "ignore_eos": True}})  # fmt: skip
        assert answer.status_code == 200  # not disturbed
        assert refusals[0].status_code == 400 and "not idle" in refusals[0].text
        assert (await http.post("/release_memory_occupation", json={})).status_code == 200
        assert (await http.post("/resume_memory_occupation", json={})).status_code == 200


async def test_a_colocated_rl_run_computes_what_a_plain_run_computes_and_records_each_phases_memory(
    tiny_model_dir, tmp_path
):
    # greedy samples (the same in both runs whatever the engine's batching), a reward that
    # differs between prompts and REINFORCE's batch-mean baseline: a gradient well above noise
    rollout = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                            sampling=SamplingConfig(max_new_tokens=4, temperature=0.0))  # fmt: skip
    figures = {}
    weights_gib = weight_bytes(tiny_model_dir) / 2**30
    for colocate in (False, True):
        async with (
            open_local_engine(tiny_model_dir, num_threads=1) as server,
            SGLangEngine(server.url, max_retries=0) as engine,
        ):  # fmt: skip
            engine_at_give_back: list[float] = []  # the engine's weights when the trainer gives

            def give_back(backend, engine=engine, seen=engine_at_give_back):  # its cached memory
                every_rank = ranks_give_back(backend)  # back: the recipe's, probed first

                async def probed() -> list[dict[str, float]]:
                    info = await engine.server_info()
                    seen.append(info["internal_states"][0]["memory_usage"]["weight"])
                    return await every_rank()

                return probed

            run = await run_loop(engine, tiny_model_dir, tmp_path / str(colocate), max_steps=3,
                                 rollout=rollout, algorithm=reinforce(),
                                 reward_fn=answer_reward, colocate=colocate,
                                 give_back=give_back)  # fmt: skip
            assert (await engine.model_info()).weight_version == "3"
        if colocate:  # the trainer's memory goes back while the engine's is still released
            assert engine_at_give_back == [0.0] * 3
            phases = [{k: v for k, v in m.items() if k.startswith("memory_")} for m in run.history]
            print(f"memory per phase (GiB): {phases}")
            for step, m in enumerate(phases):
                assert m["memory_generated_engines_weight_gib"] == pytest.approx(weights_gib, 0.01)
                assert m["memory_released_engines_weight_gib"] == 0.0
                if step:  # taken back before the push that preceded this batch
                    assert m["memory_resumed_engines_weight_gib"] == pytest.approx(
                        weights_gib, 0.01
                    )
                    assert m["memory_resumed_trainer_ranks_given_back"] == 1  # one process
        figures[colocate] = [(m["loss"], m["grad_norm"], m["reward_mean"]) for m in run.history]
        print(f"colocate={colocate}: (loss, grad_norm, reward_mean) per step {figures[colocate]}")
        assert min(m["grad_norm"] for m in run.history) > 1e-2
    # equal to float noise (<= 1e-6): the release drops the prefix cache, so the engine computes
    # a prompt's logprobs along another path than the plain run's cached one
    for mine, theirs in zip(figures[True], figures[False], strict=True):
        assert list(mine) == pytest.approx(list(theirs), rel=1e-5, abs=1e-6)


async def test_a_colocated_run_generates_again_after_an_empty_batch_on_engines_it_kept(
    tiny_model_dir, tmp_path
):
    # the loop asks for another batch when every group of one was rejected; released engines
    # would refuse its requests, so every later batch would be empty too and the run fail
    rollout = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                            max_launch_factor=1.0, max_failed_group_rate=1.0, sample_retries=0,
                            sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):  # fmt: skip
        run = await run_loop(engine, tiny_model_dir, tmp_path, max_steps=1, rollout=rollout,
                             reward_fn=failing_first(4), colocate=True,
                             max_empty_batches=2)  # fmt: skip
    assert run.history[0]["empty_batches_skipped"] == 1
    assert run.history[0]["memory_released_engines_weight_gib"] == 0.0


async def test_a_colocated_engine_marked_down_while_released_rejoins_at_the_next_resume(
    tiny_model_dir, tmp_path
):
    # engine b's /model_info goes through a fault proxy: while the trainer trains (b released),
    # the pool's version probe fails and marks b down, then the fault passes. Released, b
    # refused /health_generate and the resume skipped engines known down, so b stayed released
    # and down for the rest of the run, on step 1's weights.
    plain = FaultPlan(paths=("/model_info",))
    async with (
        trio.open_nursery() as nursery,
        open_local_engine(tiny_model_dir, num_threads=1) as a_server,
        open_local_engine(tiny_model_dir, num_threads=1) as b_server,
    ):  # fmt: skip
        proxy = FaultProxy(b_server.url, plain)
        b_url = await nursery.start(proxy.serve)
        async with (
            SGLangEngine(a_server.url, max_retries=0) as a,
            SGLangEngine(b_url, max_retries=0) as b,
            EnginePool([a, b], probe_interval_s=0.1) as pool,
        ):  # fmt: skip
            settles = 0

            def fault_while_released(backend):
                every_rank = ranks_give_back(backend)

                async def give_back() -> list[dict[str, float]]:
                    nonlocal settles
                    settles += 1
                    if settles == 2:  # step 2's training: a push (step 1's) gave b a version
                        proxy.replan(FaultPlan(rates={"reset": 1.0}, paths=("/model_info",)))
                        with trio.fail_after(10):
                            while pool.statistics().engines[1].healthy:
                                await trio.sleep(0.05)
                        assert b.resting == "released"
                        proxy.replan(plain)  # a transient fault: b answers again
                    return await every_rank()

                return give_back

            run = await run_loop(pool, tiny_model_dir, tmp_path, max_steps=3, colocate=True,
                                 give_back=fault_while_released, engines=[a, b])  # fmt: skip
            assert settles == 3 and len(run.history) == 3
            still_down = await pool.rejoin_down(10.0)
            stats = pool.statistics().engines[1]
            version = (await b.model_info()).weight_version
            print(f"b: down after the run {still_down}, rejoined {stats.rejoined} time(s), serves "
                  f"weights {version}; proxy {dict(proxy.counts)}")  # fmt: skip
            assert still_down == () and stats.rejoined == 1
            assert version == (await a.model_info()).weight_version == "3"
            greedy = {"max_new_tokens": 4, "temperature": 0}
            assert (await b.generate(PROMPT, greedy)).output_ids == (
                await a.generate(PROMPT, greedy)).output_ids  # fmt: skip
        nursery.cancel_scope.cancel()


def answer_reward(sample) -> float:
    return float(sample.metadata["answer"]) / 10  # the prompts' answers differ


def test_colocated_mode_is_refused_where_the_engines_generate_while_the_trainer_trains():
    with pytest.raises(
        ValueError, match=r"engines.colocate=true cannot run with rollout.mode=async"
    ):
        RLRunConfig.model_validate({"engines": {"colocate": True}, "rollout": {"mode": "async"}})
    assert RLRunConfig.model_validate({"engines": {"colocate": True}}).engines.colocate


def test_colocated_disk_pushes_go_through_memory_when_the_node_has_tmpfs(tmp_path):
    assert colocated_weights_dir(tmp_path / "run").parent == Path("/dev/shm")
    assert colocated_weights_dir(tmp_path / "run", shm=tmp_path / "none") == (
        tmp_path / "run" / "weights")  # fmt: skip


def test_colocated_disk_pushes_stay_on_disk_when_tmpfs_has_no_room_for_the_exports(tmp_path):
    # a container's /dev/shm is often 64 MiB: exports of a real model there fail the first push
    free = shutil.disk_usage("/dev/shm").free
    run = tmp_path / "run"
    assert colocated_weights_dir(run, model_bytes=free) == run / "weights"
    assert colocated_weights_dir(run, model_bytes=1024).parent == Path("/dev/shm")
