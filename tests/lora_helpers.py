"""Shared pieces of the LoRA engine tests: real peft adapters of the tiny model, greedy
references computed by `PeftModel` in this process, LoRA-enabled local engines.

The fixtures are imported by the test modules; what they build is cached for the session so
both modules share one set.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import trio

from engines import SGLangEngine
from engines.local import open_local_engine

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [70, 71]]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
LORA = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ("all",)}


@contextlib.contextmanager
def one_thread():
    """Reference computations on one torch thread (a shared 2-core machine), restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def make_adapter(base_dir: Path, out: Path, seed: int, rank: int = 4) -> Path:
    """A peft LoRA adapter of the tiny model whose lora_B is random (so it changes outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    # peft draws lora_A from torch's global generator: seeded here, the adapter is the same
    # whichever tests ran before in this process (under xdist that differs from run to run).
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        peft_model = get_peft_model(
            model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
        )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    peft_model.save_pretrained(out)
    return out


def misfit_adapter(source: Path, out: Path) -> Path:
    """A copy of `source` whose tensors lose a column: they fit no module of the model."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(out / "adapter_model.safetensors")
    save_file({k: v[:, :-1].contiguous() for k, v in tensors.items()},
              out / "adapter_model.safetensors")  # fmt: skip
    return out


_SESSION: dict[str, dict] = {}  # built once per session, shared by the test modules


@pytest.fixture(scope="session", name="adapters")
def adapters_fixture(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Two rank-4 adapters of the tiny model (all linear layers) and one of rank 16."""
    if "adapters" not in _SESSION:
        root = tmp_path_factory.mktemp("lora_adapters")
        _SESSION["adapters"] = {
            "a1": make_adapter(tiny_model_dir, root / "a1", seed=1),
            "a2": make_adapter(tiny_model_dir, root / "a2", seed=2),
            "rank16": make_adapter(tiny_model_dir, root / "rank16", seed=3, rank=16),
        }
    return _SESSION["adapters"]


def peft_reference(base_dir: Path, adapter: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, one full forward pass per token (no cache)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad(), one_thread():
        for _ in range(steps):
            row = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            token = int(row.argmax())
            ids.append(token)
            logprobs.append(float(row[token]))
    return ids[len(prompt) :], logprobs


@pytest.fixture(scope="session", name="references")
def references_fixture(tiny_model_dir, adapters):
    """(tokens, logprobs) per (adapter or None, prompt index), from PeftModel in this process."""
    if "references" not in _SESSION:
        out = {}
        for name in (None, "a1", "a2"):
            model = peft_reference(tiny_model_dir, adapters[name] if name else None)
            for i, prompt in enumerate(PROMPTS):
                out[name, i] = greedy(model, prompt, GREEDY["max_new_tokens"])
        _SESSION["references"] = out
    return _SESSION["references"]


def assert_matches(result, reference) -> None:
    tokens, logprobs = reference
    assert list(result.output_ids) == tokens
    assert max(abs(a - b) for a, b in zip(result.output_logprobs, logprobs, strict=True)) < 1e-5


@pytest.fixture(name="lora_engine")
async def lora_engine_fixture(tiny_model_dir):
    """A LoRA-enabled local engine (rank <= 8, all modules) plus a client without retries."""
    async with (
        open_local_engine(tiny_model_dir, num_threads=1, **LORA) as server,
        SGLangEngine(server.url, max_retries=0) as engine,
    ):
        yield server, engine


async def post(url: str, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.post(path, json=body)


async def run_engine(model_dir, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A LoRA-enabled local engine on `port` until this task is cancelled (= it dies)."""
    async with open_local_engine(model_dir, port=port, num_threads=1, **LORA) as server:
        task_status.started(server)
        await trio.sleep_forever()


async def loaded_on(url: str) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=url) as http:
        cards = (await http.get("/v1/models")).json()["data"]
    return {c["id"]: c["root"] for c in cards if c["parent"] is not None}
