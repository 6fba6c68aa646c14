"""`rollouts tinker-serve`: Tinker's training API on this machine.

    rollouts tinker-serve --model PATH [--engine-url URL] [--port 8000] [--run-dir DIR]

A program written for the `tinker` SDK then runs unchanged against it:
`tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-local")` (or
`TINKER_BASE_URL` / `TINKER_API_KEY`). Sampling runs on a local engine this command starts
(LoRA on, `--max-lora-rank`), or on the SGLang-protocol engine at `--engine-url` (it must
share this machine's disk: adapters and weights travel as files). docs/tinker.md has the
served routes, the refused ones and the errors.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from engines.local.http11 import ConnectionLimits, serve_http
from rollouts.tinker_server.routes import build_app
from rollouts.tinker_server.service import TinkerService

log = logging.getLogger("rollouts.tinker")


@dataclass
class TinkerServer:
    url: str
    service: TinkerService


@contextlib.asynccontextmanager
async def open_tinker_server(model_path: str | Path, run_dir: str | Path, *,
                             engine_url: str | None = None, host: str = "127.0.0.1",
                             port: int = 0, model_names: Sequence[str] = (),
                             max_lora_rank: int = 32, num_threads: int | None = None,
                             device: str = "cpu", dtype: str = "float32",
                             client_config: dict | None = None,
                             ) -> AsyncIterator[TinkerServer]:  # fmt: skip
    """Serve the Tinker API (and its sampling engine) in the caller's task; yield once both
    answer. `port` 0 picks a free port (`server.url`). `device`/`dtype`: of the trainers and
    of the local engine. `client_config`: flags sent to the SDK over the defaults
    (routes.CLIENT_CONFIG), e.g. `{"fwdbwd_max_chunk_len": 1}`."""
    from engines import SGLangEngine
    from engines.local import open_local_engine

    async with contextlib.AsyncExitStack() as stack:
        if engine_url is None:
            local = await stack.enter_async_context(open_local_engine(
                str(model_path), num_threads=num_threads, enable_lora=True, device=device,
                dtype=dtype,
                max_lora_rank=max_lora_rank, lora_target_modules=("all",)))  # fmt: skip
            engine_url = local.url
        engine = await stack.enter_async_context(SGLangEngine(engine_url, max_retries=0))
        nursery = await stack.enter_async_context(trio.open_nursery())
        service = TinkerService(str(model_path), Path(run_dir), engine, nursery,
                                model_names=tuple(model_names), max_lora_rank=max_lora_rank,
                                device=device, dtype=dtype, client_config=client_config)  # fmt: skip
        app = build_app(service)
        urls = await nursery.start(serve_http, app, host, port,
                                   ConnectionLimits(read_timeout_s=300.0))  # fmt: skip
        log.info("tinker API on %s (model %s, engine %s)", urls[0], model_path, engine_url)
        try:
            yield TinkerServer(urls[0], service)
        finally:
            nursery.cancel_scope.cancel()
            for model in service.models.values():
                model.backend.close()


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog or "rollouts tinker-serve",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--model", required=True, help="HF model directory (the base model)")
    parser.add_argument("--model-name", action="append", default=[],
                        help="another base_model name clients may use for it (repeatable), "
                             "e.g. the HF id a recipe passes")  # fmt: skip
    parser.add_argument("--engine-url", default=None,
                        help="a running SGLang-protocol engine of the same model on this "
                             "machine (default: start a local engine)")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--run-dir", default="tinker_runs",
                        help="where save_state checkpoints and sampler weights go")  # fmt: skip
    parser.add_argument("--max-lora-rank", type=int, default=32)
    parser.add_argument(
        "--device", default=None, help="cpu or cuda (default: cuda if there is one)"
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="of the trained weights and the local engine")  # fmt: skip
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads of the local engine")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call otherwise

    async def run() -> None:
        async with open_tinker_server(args.model, args.run_dir, engine_url=args.engine_url,
                                      host=args.host, port=args.port,
                                      model_names=args.model_name,
                                      max_lora_rank=args.max_lora_rank,
                                      num_threads=args.num_threads, device=args.device,
                                      dtype=args.dtype) as server:  # fmt: skip
            print(f"tinker API on {server.url}: tinker.ServiceClient(base_url="
                  f"{server.url!r}, api_key='tml-local')", flush=True)  # fmt: skip
            await trio.sleep_forever()

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run)
    return 0
