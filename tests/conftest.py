"""Shared fixtures. Expensive artefacts (the tiny model directory) are session-scoped and sync,
so both trio and plain tests can use them (pytest-trio async fixtures must be function-scoped)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built tiny model (seed 0) shared by the whole session. Treat as read-only."""
    from training.backend.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def distributed_grads(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step's gradients at world 1 and 2 for every mode (tests/distributed_launch.py)."""
    from tests.distributed_launch import gradient_runs

    return gradient_runs(tiny_model_dir, tmp_path_factory.mktemp("grads"))


@pytest.fixture(scope="session")
def tiny_model_dir_seed1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as `tiny_model_dir`, different weights (seed 1)."""
    from training.backend.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model_seed1"), seed=1)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ----- engines ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir: Path):
    """The tiny model loaded in this process (float32, eval): the reference the engine must match."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture
async def local_engine(tiny_model_dir: Path):
    """A local engine server on a free loopback port, in this test's nursery, plus a client.

    Yields (server, engine): `server.url`, `server.state` (in-process state, for inspection
    only) and an open `SGLangEngine` without retries.
    """
    from engines import SGLangEngine
    from engines.local import open_local_engine

    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):
        yield server, engine
