"""`python -m engines.local --model-path DIR [...]`: the local engine server (SGLang's flags)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import trio

from plumbing.errors import ModelLoadError
from plumbing.model_paths import resolve_model_dir
from plumbing.threads import strict_blas

from .exact_logprobs import DEFAULT_SCORER
from .openai_tools import check_parser_name
from .server import serve
from .state import LocalEngineConfig


def build_parser(prog: str = "python -m engines.local") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="A CPU inference server speaking SGLang's HTTP protocol (HF transformers).",
    )
    parser.add_argument(
        "--model-path",
        "--model",
        required=True,
        help="HF model, run, checkpoints or checkpoint directory",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--admin-api-key", default=None, help="the only key for control routes (pause, update)"
    )
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--max-running-requests", type=int, default=128)
    parser.add_argument("--max-prefill-tokens", type=int, default=8192)
    parser.add_argument(
        "--max-prefix-cache-tokens",
        type=int,
        default=16384,
        help="tokens of KV the radix prefix cache may hold, least recently used evicted first",
    )
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--exact-logprobs",
        action="store_true",
        help="return the sampled tokens' logprobs as the trainer computes them: each finished "
        "request rescored alone, one full forward (batch-invariant; docs/engines.md)",
    )
    parser.add_argument(
        "--exact-logprobs-scorer",
        default=DEFAULT_SCORER,
        help="module:function that rescores a sequence in --exact-logprobs mode",
    )
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
    parser.add_argument(
        "--tool-call-parser",
        default="hermes",
        help="reads tool calls out of /v1/chat/completions answers to requests with tools: "
        "hermes (alias qwen25), xml, none, or module:function (default hermes)",
    )
    lora = parser.add_argument_group("LoRA serving (SGLang's flags)")
    lora.add_argument("--enable-lora", action="store_true", default=None)
    lora.add_argument(
        "--max-lora-rank", type=int, default=None, help="default: the largest of --lora-paths"
    )
    lora.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        help="module names (q_proj, v_proj, ...) or 'all'; default: those of --lora-paths",
    )
    lora.add_argument("--max-loras-per-batch", type=int, default=8)
    lora.add_argument("--max-loaded-loras", type=int, default=None)
    lora.add_argument(
        "--lora-paths", nargs="*", default=(), help="adapters loaded at start: PATH or NAME=PATH"
    )
    bounds = parser.add_argument_group(
        "bounds for a server on a shared machine (400/413 past them)"
    )
    bounds.add_argument(
        "--max-request-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="largest request body (413; checked on Content-Length first)",
    )
    bounds.add_argument("--max-n", type=int, default=256, help="largest n (samples per prompt)")
    bounds.add_argument(
        "--max-request-items", type=int, default=4096, help="largest prompts x n in one request"
    )
    bounds.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="admitted connections (head sent, key checked) served at once; one more is 503",
    )
    bounds.add_argument(
        "--max-pre-auth-connections",
        type=int,
        default=64,
        help="connections not yet admitted; a newcomer over this closes the oldest",
    )
    bounds.add_argument(
        "--pre-auth-timeout",
        type=float,
        default=5.0,
        help="seconds from accept for a connection to send an admitted request head",
    )
    bounds.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a request head",
    )
    bounds.add_argument(
        "--keep-alive-timeout", type=float, default=15.0, help="seconds an idle connection is kept"
    )
    bounds.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive in full (408), and one response write",
    )
    bounds.add_argument(
        "--weights-root",
        default=None,
        help="/update_weights_from_disk loads only directories under this one "
        "(default: any directory the server can read)",
    )
    bounds.add_argument(
        "--weight-group-timeout",
        type=float,
        default=300.0,
        help="seconds a weight-update group's rendezvous or broadcast may take "
        "(/init_weights_update_group, /update_weights_from_distributed)",
    )
    return parser


def main(argv: list[str] | None = None, *, prog: str = "python -m engines.local") -> int:
    """The server's command line; `prog` is how the help names it (`rollouts serve`)."""
    args = build_parser(prog).parse_args(argv)
    if args.exact_logprobs:  # before the model's first matrix product (exact_logprobs.py)
        strict_blas()
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Half the cores: the event loop, tokenizer and HTTP need the rest, and oversubscribed
    # OpenMP threads collapse throughput on a shared machine (see the module docs).
    threads = args.num_threads or max(1, (os.cpu_count() or 2) // 2)
    try:  # a run, checkpoints or checkpoint directory serves its latest HF model
        model_path = resolve_model_dir(args.model_path, what="--model-path")
        check_parser_name(args.tool_call_parser)
    except (ModelLoadError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    config = LocalEngineConfig(
        model_path=model_path,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        weight_version=args.weight_version,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        max_prefix_cache_tokens=args.max_prefix_cache_tokens,
        disable_radix_cache=args.disable_radix_cache,
        dtype=args.dtype,
        device=args.device,
        exact_logprobs=args.exact_logprobs,
        exact_logprobs_scorer=args.exact_logprobs_scorer,
        served_model_name=args.served_model_name,
        random_seed=args.random_seed,
        num_threads=threads,
        incremental_streaming_output=args.incremental_streaming_output,
        skip_server_warmup=args.skip_server_warmup,
        max_request_bytes=args.max_request_bytes,
        max_n=args.max_n,
        max_request_items=args.max_request_items,
        max_connections=args.max_connections,
        max_pre_auth_connections=args.max_pre_auth_connections,
        pre_auth_timeout_s=args.pre_auth_timeout,
        header_timeout_s=args.header_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        read_timeout_s=args.read_timeout,
        weights_root=args.weights_root,
        weight_group_timeout_s=args.weight_group_timeout,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=(
            None if args.lora_target_modules is None else tuple(args.lora_target_modules)
        ),
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        lora_paths=tuple(args.lora_paths or ()),
        tool_call_parser=args.tool_call_parser,
    )
    try:
        trio.run(serve, config)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
