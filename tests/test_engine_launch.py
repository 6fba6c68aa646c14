"""`launch_engine` with real processes: `python -m engines.local` on the tiny model, and small
stand-in commands for the failure paths (a process that exits, one that never gets healthy)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import httpx
import pytest
import trio

from engines import EngineLaunchError, SGLangEngine, find_free_port, launch_engine


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pids_with_port(port: int) -> list[int]:
    """Processes whose command line contains `--port <port>`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in argv and str(port).encode() in argv:
            found.append(int(entry.name))
    return found


async def test_launch_engine_serves_then_the_process_is_gone(tiny_model_dir, tmp_path):
    log = tmp_path / "engine.log"
    async with launch_engine(
        kind="local", model_path=tiny_model_dir, log_path=log, extra_args=["--weight-version", "v7"]
    ) as launched:
        assert alive(launched.pid) and launched.url.startswith("http://127.0.0.1:")
        async with SGLangEngine(launched.url) as engine:
            result = await engine.generate([1, 2, 3], {"max_new_tokens": 3})
            assert result.completion_tokens == 3 and result.weight_version == "v7"
    assert not alive(launched.pid)
    assert "ready to roll" in log.read_text()


@pytest.mark.parametrize("supervised", [False, True], ids=["launched", "supervised"])
async def test_a_cancelled_runs_shielded_cleanup_can_still_use_its_engine(
    tiny_model_dir, tmp_path, supervised
):
    # Ctrl-C cancels the whole run; its cleanup (resume the engines, abort requests) runs
    # shielded inside the engine's block and must find the engine alive: only leaving the block
    # stops it. Before, the process task was cancelled with the run and SIGTERM'd at once.
    from engines.supervisor import supervise_engine

    opened = supervise_engine if supervised else launch_engine
    with trio.CancelScope() as run:
        async with opened(kind="local", model_path=tiny_model_dir, log_path=tmp_path / "log") as e:
            url, pid = (e.url, e.current.pid) if supervised else (e.url, e.pid)
            try:
                run.cancel()
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True), trio.fail_after(30):
                    await trio.sleep(0.5)  # the SIGTERM, had it been sent, has landed by now
                    async with SGLangEngine(url) as engine:
                        result = await engine.generate([1, 2, 3], {"max_new_tokens": 2})
                    assert result.completion_tokens == 2 and alive(pid)
    assert run.cancelled_caught and not alive(pid)


async def test_cancelling_launch_mid_start_leaves_no_process(tiny_model_dir, tmp_path):
    port = find_free_port()
    seen: list[int] = []
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def launch() -> None:
                async with launch_engine(
                    kind="local", model_path=tiny_model_dir, port=port, log_path=tmp_path / "log"
                ):
                    pytest.fail("the engine must not become ready before the cancel")

            nursery.start_soon(launch)
            # The server binds before it loads the model and answers 503 meanwhile (as SGLang
            # does): seeing that 503 proves we cancel in the middle of the start.
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                with trio.fail_after(60):
                    while True:
                        try:
                            status = (await http.get("/health")).status_code
                            break
                        except httpx.TransportError:
                            await trio.sleep(0.01)
            assert status == 503
            seen.extend(pids_with_port(port))
            scope.cancel()
    assert scope.cancelled_caught and seen
    assert not any(alive(pid) for pid in seen) and pids_with_port(port) == []


async def test_a_process_that_exits_early_raises_with_its_log_tail(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('model weights are corrupt'); sys.exit(3)"]
    with pytest.raises(EngineLaunchError) as info:
        async with launch_engine(crash, model_path="unused", log_path=tmp_path / "log"):
            pass
    assert "exited with code 3" in str(info.value) and "model weights are corrupt" in str(
        info.value
    )


async def test_a_process_that_never_gets_healthy_times_out_and_is_killed(tmp_path):
    hang = [
        sys.executable,
        "-c",
        "import time; print('loading forever', flush=True); time.sleep(600)",
    ]
    port = find_free_port()
    with pytest.raises(EngineLaunchError, match="not healthy after 1.0 s") as info:
        async with launch_engine(
            hang, model_path="unused", port=port, startup_timeout_s=1.0, log_path=tmp_path / "log"
        ):
            pass
    assert "loading forever" in str(info.value)
    assert pids_with_port(port) == []


async def test_a_picked_port_another_process_binds_first_is_picked_again(
    tiny_model_dir, tmp_path, monkeypatch
):
    # the port is free when picked and bound by the server only after its imports (seconds
    # later); another process (an xdist worker, any client's ephemeral port) could take it
    # meanwhile, and the launch failed with "address already in use"
    import engines.launch as launch_module

    with socket.socket() as taker:
        taker.bind(("127.0.0.1", 0))
        taken = taker.getsockname()[1]
        picks = [taken]
        pick = launch_module.find_free_port
        monkeypatch.setattr(launch_module, "find_free_port",
                            lambda host="127.0.0.1": picks.pop() if picks else pick(host))  # fmt: skip
        with trio.fail_after(120):
            async with launch_engine(kind="local", model_path=tiny_model_dir,
                                     log_path=tmp_path / "log") as launched:  # fmt: skip
                assert launched.port != taken and not picks
                async with SGLangEngine(launched.url) as engine:
                    assert (
                        await engine.generate([1, 2], {"max_new_tokens": 2})
                    ).completion_tokens == 2
    assert "already in use" in (tmp_path / "log").read_text().lower()
