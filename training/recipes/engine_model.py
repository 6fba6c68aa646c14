"""The model to train when `--engine-url` is given without `--model`: the one the engine serves.

The policy being trained must be the model the engine generates with (its first weight push
replaces the engine's weights with the trainer's), so without `--model` the only sensible start
is the engine's own model: `model_path` from its `/model_info` (`/get_model_info` on older
SGLang). That path is the engine's; it is used only when it is a model directory on this
machine too (same filesystem, as weight syncs from disk need anyway). Otherwise the run stops
at once naming `--model`, instead of falling back to a start the user did not ask for (the SFT
preamble `sft_config` runs for the launched-local-engine demo).
"""

from __future__ import annotations

import logging
from pathlib import Path

from engines.client import EngineTimeouts, SGLangEngine
from engines.vllm import VLLMEngine
from plumbing.errors import ConfigError
from training.rl_config import EnginesConfig

log = logging.getLogger("rollouts.rl_recipe")


async def model_served_by(engines: EnginesConfig, *, timeout_s: float = 10.0) -> str:
    """The model directory the first engine (or the router) serves, if it exists here.

    Raises:
        ConfigError: the engine names no model path, or one that is not a model directory on
            this machine (the message says to pass `--model`).
    """
    url = engines.urls[0] if engines.urls else engines.router_url
    assert url is not None, "model_served_by: no engine URL configured"
    timeouts = EngineTimeouts(connect_s=timeout_s, control_s=timeout_s, health_s=timeout_s)
    kind = VLLMEngine if engines.kind == "vllm" else SGLangEngine  # vLLM: its /v1/models id
    async with kind(url, api_key=engines.api_key, timeouts=timeouts,
                    max_retries=0) as engine:  # fmt: skip
        path = (await engine.model_info()).model_path
    flag = "--engine-url" if engines.urls else "--router-url"
    if not path:
        raise ConfigError(
            f"{flag} {url}: its /model_info names no model_path; pass --model with the "
            "directory of the model the engine serves (the policy to train)"
        )
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"{flag} {url} serves model_path {path!r}, which is not a model directory on this "
            "machine; pass --model with a local copy of that model (the policy to train; its "
            "weights are pushed to the engine)"
        )
    log.info("no --model: training the model %s serves, %s", url, path)
    return str(Path(path))
