"""The local engine: a CPU inference server that speaks SGLang's HTTP protocol.

Layers: `params` (request validation, pure) → `scheduler` (trio, continuous batching) →
`runner` (torch, batched KV cache), with `scheduler_control` (pause, flush, weight updates);
`http11` (the bounded HTTP/1.1 server) + `asgi` + `route_helpers` + `native_api` +
`openai_api` (+ `openai_requests`, `openai_tools`) + `lora_api` are the HTTP side; `server` assembles them. LoRA:
`lora_registry` (SGLang's adapter rules, pure) and `lora_runner` (peft inside the runner).
Importing this package does not import torch.
"""

import plumbing.threads  # noqa: F401  (first: sets OpenMP's wait policy before torch loads)

from .server import LocalEngineServer as LocalEngineServer
from .server import open_local_engine as open_local_engine
from .server import serve as serve
from .state import LocalEngineConfig as LocalEngineConfig
