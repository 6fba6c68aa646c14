"""`python -m engines.local --model-path DIR [...]`: the local engine server (SGLang's flags)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import trio

from .server import serve
from .state import LocalEngineConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engines.local",
        description="A CPU inference server speaking SGLang's HTTP protocol (HF transformers).",
    )
    parser.add_argument("--model-path", "--model", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--admin-api-key", default=None, help="the only key for control routes (pause, update)"
    )
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--max-running-requests", type=int, default=128)
    parser.add_argument("--max-prefill-tokens", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads of the model thread (default: half the cores, at least 1)",
    )
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument("--log-level", default="info")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Half the cores: the event loop, tokenizer and HTTP need the rest, and oversubscribed
    # OpenMP threads collapse throughput on a shared machine (see the module docs).
    threads = args.num_threads or max(1, (os.cpu_count() or 2) // 2)
    config = LocalEngineConfig(
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        weight_version=args.weight_version,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        dtype=args.dtype,
        device=args.device,
        served_model_name=args.served_model_name,
        random_seed=args.random_seed,
        num_threads=threads,
        incremental_streaming_output=args.incremental_streaming_output,
        skip_server_warmup=args.skip_server_warmup,
    )
    try:
        trio.run(serve, config)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
