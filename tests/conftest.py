"""Shared fixtures. Expensive artefacts (the tiny model directory) are session-scoped and sync,
so both trio and plain tests can use them (pytest-trio async fixtures must be function-scoped).

Under pytest-xdist (`make test` runs with workers) each worker is its own session: the
artefacts that cost a build or a torchrun launch are made once per run, by whichever worker
asks first, in the run's shared temp folder, and read by the others (`_built_once`).
"""

from __future__ import annotations

import fcntl
import gc
import os
from collections.abc import Callable
from pathlib import Path

import pytest

# wandb is installed for its logger tests (the dev extra): it never reaches the network from a
# test run, and a run started without `dir=` writes under the system temp folder, not the repo.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "rollouts-wandb"))


def _run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp folder every worker of this run shares (this session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]
) -> Path:
    """`build(folder)` once per run for `name` (which must say everything the result depends
    on), under a file lock so that parallel workers wait for the first one instead of building
    their own copy; a build that failed is retried by the next worker that asks."""
    out = _run_dir(tmp_path_factory) / name
    with open(out.with_name(f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when `lock` closes
        done = out.with_name(f"{name}.built")  # beside it: the folder holds only the artefact
        if not done.exists():
            out.mkdir(exist_ok=True)
            build(out)
            done.touch()
    return out


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the slow tests first: under xdist (`make test`, --dist loadfile) the files holding
    them are handed out first, so no worker starts a long file last while the others idle.
    Stable, so a file's tests keep their order."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# Files whose tests are each a separate program with no shared module fixture: `--dist
# loadfile` would run each of them on one worker, one test after another (test_docs.py runs
# every documented snippet as its own process: minutes on one worker). Their tests are handed
# out one by one instead; every other file stays on one worker, for its module fixtures.
SPREAD_FILES = ("tests/test_docs.py",)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, except that the tests of SPREAD_FILES are scheduled one by one."""
    from xdist.scheduler import LoadScopeScheduling

    class FilesExceptSpread(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in SPREAD_FILES else path

    return FilesExceptSpread(config, log)


if os.environ.get("ROLLOUTS_TEST_CPU"):  # `make test-cpu`: where the suite's CPU goes

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
        from tests.cpu_usage import CPURecorder

        done = CPURecorder(os.environ["ROLLOUTS_TEST_CPU"]).around(item.nodeid)
        yield
        done()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built tiny model (seed 0) shared by the whole run. Treat as read-only."""
    from training.backend.tiny_model import build_tiny_model

    return _built_once(tmp_path_factory, "tiny_model_seed0", lambda d: build_tiny_model(d, seed=0))


@pytest.fixture(scope="session")
def distributed_grads(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                      warm_python) -> Path:  # fmt: skip
    """One step's gradients at world 1 and 2 for every mode (tests/distributed_launch.py), the
    ranks forked from the warm interpreter: these tests are about what ranks compute; torchrun
    itself is run by test_distributed's, test_two_nodes' and test_torchrun_exit's jobs."""
    from tests.distributed_launch import gradient_runs

    return _built_once(tmp_path_factory, "grads",
                       lambda d: gradient_runs(tiny_model_dir, d, warm=warm_python))  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model_dir_seed1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as `tiny_model_dir`, different weights (seed 1)."""
    from training.backend.tiny_model import build_tiny_model

    return _built_once(tmp_path_factory, "tiny_model_seed1", lambda d: build_tiny_model(d, seed=1))


@pytest.fixture(scope="session")
def warm_python():
    """This worker's warm interpreter (tests/warm_python.py) for its tests that run a whole
    program to completion: each is forked from a process that has torch and transformers
    imported, instead of paying ~3 CPU s of imports."""
    from tests.warm_python import shared

    return shared()


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


def pytest_sessionstart(session: pytest.Session) -> None:
    """Collection imports every test module (torch, transformers, ...) with the cyclic collector
    off, as the project's processes import (plumbing/gc_pause.py); see the next hook."""
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection built to the collector's permanent generation, then turn it back on:
    the full passes that hundreds of tests trigger later walk only what the tests allocate."""
    gc.collect()
    gc.freeze()
    gc.enable()
