"""Start `rollouts tinker-serve` for the tinker examples when no server is given.

Not part of what the examples show (they use only the `tinker` SDK): a way to get a server
on 127.0.0.1 for them, on the tiny model (built on first use) unless `--model` says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tinker_server(base_url: str | None, model: str, run_dir: str) -> Iterator[str]:
    """`base_url` if given (or TINKER_BASE_URL), else a `rollouts tinker-serve` started here
    and stopped at exit; yields the URL to pass to `tinker.ServiceClient(base_url=...)`."""
    base_url = base_url or os.environ.get("TINKER_BASE_URL")
    if base_url:
        yield base_url
        return
    if not Path(model).is_dir():
        from training.backend.tiny_model import build_tiny_model

        build_tiny_model(model, seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "rollouts.tinker_server", "--model", model,
               "--port", str(port), "--run-dir", run_dir, "--num-threads", "1"]  # fmt: skip
    process = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"`{' '.join(command)}` did not start serving") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
