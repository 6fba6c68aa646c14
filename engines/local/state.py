"""Configuration and shared state of a local engine server, and SGLang-shaped output records."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import trio

from .exact_logprobs import DEFAULT_SCORER
from .http11 import ServerStatistics
from .lora_registry import parse_lora_paths
from .openai_tools import resolve_parser
from .params import (
    GenerateItem,
    GenerateRequest,
    ModelLimits,
    RequestBounds,
    parse_generate_request,
)
from .pause_lease import PauseLease
from .sequence import Sequence, TopLogprobs

VERSION = "0.5.23+rollouts.local"  # the SGLang release whose behaviour it follows


@dataclass(frozen=True)
class LocalEngineConfig:
    """Server options; the names are SGLang's `launch_server` flags (`--max-running-requests`)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None  # control routes (pause, update, abort, flush, ...)
    weight_version: str = "default"
    max_running_requests: int = 128
    max_prefill_tokens: int = 8192
    # the radix prefix cache (prefix_cache.py): tokens of KV it may hold (LRU past that);
    # `--disable-radix-cache` (SGLang's flag) turns it off
    max_prefix_cache_tokens: int = 16384
    disable_radix_cache: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    # exact_logprobs.py: finished requests' output logprobs recomputed with the trainer's
    # numerics (`scorer`, module:function), one full forward of each sequence alone
    exact_logprobs: bool = False
    exact_logprobs_scorer: str = DEFAULT_SCORER
    served_model_name: str | None = None
    random_seed: int = 0
    num_threads: int | None = None  # torch intra-op threads of the model thread; None = torch's
    incremental_streaming_output: bool = False
    skip_server_warmup: bool = False
    # Bounds for a server exposed on a shared machine (issue 15); 400/413 past them.
    max_request_bytes: int = 32 * 1024 * 1024
    max_n: int = 256  # samples per prompt
    max_request_items: int = 4096  # prompts x n in one request
    max_connections: int = 512  # admitted connections (head read, key checked)
    max_pre_auth_connections: int = 64  # accepted, head not yet admitted; oldest evicted
    pre_auth_timeout_s: float = 5.0  # from accept to an admitted head
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 15.0  # longer than httpx's 5 s pool expiry: clients close first
    read_timeout_s: float = 30.0
    # `/update_weights_from_disk` loads only directories under this one; None: any directory
    # (the trainer exports wherever its run lives, so that stays the default).
    weights_root: str | None = None
    # A weight-update process group's deadline (`/init_weights_update_group`): the rendezvous
    # and every broadcast fail after it. SGLang uses torch's default (30 min); a trainer that
    # dies mid-broadcast closes its sockets, which ends the wait at once anyway.
    weight_group_timeout_s: float = 300.0
    # LoRA serving, SGLang's flags (`--enable-lora`, ...; see lora_registry.py). None for rank
    # and target modules: inferred from `lora_paths` (required without them).
    enable_lora: bool | None = None
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    lora_paths: tuple[str, ...] = ()  # "PATH", "NAME=PATH" or JSON, loaded at start-up
    # reads tool calls out of `/v1/chat/completions` answers to requests with tools
    # (`hermes`, `xml`, `none` or module:function; openai_tools.py)
    tool_call_parser: str | None = "hermes"

    @property
    def lora_enabled(self) -> bool:
        """SGLang: `--lora-paths` turns LoRA on unless `--enable-lora` was set to False."""
        return bool(self.enable_lora) or (self.enable_lora is None and bool(self.lora_paths))

    def server_args(self) -> dict[str, Any]:
        args = asdict(self)
        args.pop("api_key")  # never echo a secret in /get_server_info
        args.pop("admin_api_key")
        args["tokenizer_path"] = self.model_path
        args["served_model_name"] = self.served_model_name or self.model_path
        args.update(tp_size=1, dp_size=1, skip_tokenizer_init=False)
        args["enable_lora"] = self.lora_enabled
        args["lora_paths"] = [vars(ref) for ref in parse_lora_paths(self.lora_paths)]
        args["lora_target_modules"] = (
            None if self.lora_target_modules is None else list(self.lora_target_modules)
        )
        return args


class EngineState:
    """What the HTTP handlers share: config, tokenizer, and the scheduler once loaded."""

    def __init__(self, config: LocalEngineConfig) -> None:
        self.config = config
        self.created = int(time.time())
        self.ready = trio.Event()
        self.scheduler: Any = None  # Scheduler, set when the model is loaded
        self.lora: Any = None  # LoraRegistry, set when the model is loaded
        self.pause_lease = PauseLease()  # a pause's lease (pause_lease.py)
        self.tokenizer: Any = None
        self.limits: ModelLimits | None = None
        self.model_type = ""
        self.architectures: list[str] = []
        self._token_text: dict[int, str] = {}
        self._tool_parser: Any = None
        self.http_stats = ServerStatistics()  # open/refused/timed-out connections

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name or self.config.model_path

    @property
    def model_path(self) -> str:
        return self.scheduler.model_path if self.scheduler else self.config.model_path

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version if self.scheduler else self.config.weight_version

    def tool_parser(self) -> Any:
        """The `--tool-call-parser` function, loaded at its first use (openai_tools.py).

        Raises:
            ValueError: it cannot be loaded (the message names the flag).
        """
        if self._tool_parser is None:
            self._tool_parser = resolve_parser(str(self.config.tool_call_parser))
        return self._tool_parser

    # ----- tokenizer helpers ----------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def parse(self, body: Any) -> GenerateRequest:
        assert self.limits is not None
        return parse_generate_request(
            body,
            self.limits,
            self.encode,
            RequestBounds(self.config.max_n, self.config.max_request_items),
        )

    # ----- SGLang output records ------------------------------------------------------------

    def output_text(self, seq: Sequence, *, final: bool) -> str:
        """Detokenised completion; on the final record the matched stop is trimmed (SGLang)."""
        params, reason = seq.item.params, seq.finish_reason or {}
        ids = seq.output_ids
        matched = reason.get("matched") if reason.get("type") == "stop" else None
        if final and isinstance(matched, int) and not params.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.decode(ids, params.skip_special_tokens)
        if final and isinstance(matched, str) and not params.no_stop_trim:
            position = text.find(matched)
            if position != -1:
                text = text[:position]
        return text

    def _triples(self, item: GenerateItem, logprobs, token_ids) -> list[list[Any]]:
        with_text = item.return_text_in_logprobs
        return [
            [lp, tid, self.token_text(tid) if with_text else None]
            for lp, tid in zip(logprobs, token_ids, strict=True)
        ]

    def _top(self, item: GenerateItem, rows: list[TopLogprobs | None]) -> list[Any]:
        return [
            None if row is None else self._triples(item, [lp for lp, _ in row], [t for _, t in row])
            for row in rows
        ]

    def meta_info(self, seq: Sequence, *, final: bool) -> dict[str, Any]:
        item = seq.item
        spans = [{"version": v, "start": s, "end": e} for v, s, e in seq.weight_spans]
        meta: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": seq.finish_reason if final else None,
            "prompt_tokens": len(item.input_ids),
            "weight_version": spans[-1]["version"] if spans else self.weight_version,
            "num_retractions": seq.num_retractions,
        }
        if item.return_logprob:
            prompt_part = item.input_ids[item.logprob_start_len :]
            input_lp = seq.input_logprobs or []
            meta["input_token_logprobs"] = self._triples(
                item, input_lp, prompt_part[: len(input_lp)]
            )
            meta["output_token_logprobs"] = self._triples(item, seq.output_logprobs, seq.output_ids)
            meta["output_token_logprobs_length"] = len(seq.output_ids)
            if item.top_logprobs_num:
                meta["input_top_logprobs"] = self._top(item, seq.input_top or [])
                meta["output_top_logprobs"] = self._top(item, seq.output_top)
        meta.update(
            reasoning_tokens=0,
            completion_tokens=len(seq.output_ids),
            cached_tokens=seq.cached_tokens,
            cached_tokens_details=None,
            dp_rank=None,
            weight_versions=spans,
        )
        if final:
            meta["e2e_latency"] = time.perf_counter() - seq.created_at
            meta["response_sent_to_client_ts"] = time.time()
        return meta

    def generate_record(self, seq: Sequence, *, final: bool = True) -> dict[str, Any]:
        return {
            "text": self.output_text(seq, final=final),
            "output_ids": list(seq.output_ids),
            "meta_info": self.meta_info(seq, final=final),
        }
