"""What a checkpoint stores: the model's weights once (the HF export), the optimizer in DCP.

The properties: no weight of the model is both in `model.safetensors` and in `dcp/`, so a
checkpoint is about one model plus the optimizer state on disk; resuming from it continues
the loss curve exactly (also with an output layer tied to the embeddings, which the export
writes once); a checkpoint written before, with the model inside `dcp/`, still resumes from
there; weights that do not fit the model are a clear error. Resuming at another world size is
in tests/test_distributed.py (1 → 2) and tests/test_two_nodes.py (2 → 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollouts.errors import CheckpointError
from rollouts.tasks.arithmetic import make_problems
from training.backend import state as st
from training.backend.checkpoint import DCP_DIR
from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.data.tokenize import tokenize_conversation


@pytest.fixture(scope="module")
def samples(tiny_tokenizer):
    problems = make_problems(64, seed=7, min_digits=1, max_digits=3)
    return [tokenize_conversation(tiny_tokenizer, p.sft_record()["messages"]) for p in problems]


@pytest.fixture(scope="module")
def tied_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model's architecture with the output layer tied to the embeddings (as
    Qwen2.5-0.5B has it): its HF export holds the shared matrix once."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    out = tmp_path_factory.mktemp("tied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def make_backend(model_dir: Path, checkpoint_dir: Path) -> PyTorchTrainingBackend:
    model, tok = load_model_and_tokenizer(model_dir)
    return PyTorchTrainingBackend(model, tok, optim=OptimConfig(lr=1e-3, warmup_steps=1),
                                  max_steps=10, checkpoint_dir=checkpoint_dir)  # fmt: skip


async def train(backend: PyTorchTrainingBackend, batches: list[list]) -> list[float]:
    losses = []
    for batch in batches:
        fb = backend.forward_backward(batch)
        await backend.optim_step().result()
        losses.append((await fb.result())["loss"])
    return losses


def dcp_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path / DCP_DIR)).read_metadata().state_dict_metadata)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def resumed_losses(model_dir, checkpoint, tmp_path, batches) -> list[float]:
    with make_backend(model_dir, tmp_path / "resumed") as fresh:
        await fresh.load_checkpoint(checkpoint)
        return await train(fresh, batches)


async def test_a_checkpoint_stores_the_model_once_and_resumes_exactly(
    tiny_model_dir, tmp_path, samples
):
    from transformers import AutoModelForCausalLM

    batches = [samples[k : k + 16] for k in range(0, 64, 16)]
    with make_backend(tiny_model_dir, tmp_path / "ckpt") as backend:
        await train(backend, batches[:2])
        path = await backend.save_checkpoint(2, {})
        straight = await train(backend, batches[2:])
    keys = dcp_keys(path)
    assert keys and all(k.startswith("optim.") for k in keys), sorted(keys)[:5]
    model_bytes = (path / "model.safetensors").stat().st_size
    # AdamW keeps two moments per weight: the optimizer is ~2 models, the whole ~3.
    assert dir_bytes(path / DCP_DIR) < 2.1 * model_bytes
    assert dir_bytes(path) < 3.1 * model_bytes
    AutoModelForCausalLM.from_pretrained(path)  # the HF layout still loads
    assert await resumed_losses(tiny_model_dir, path, tmp_path, batches[2:]) == straight


async def test_tied_output_weights_resume_from_the_one_copy_in_the_export(
    tied_model_dir, tmp_path, samples
):
    batches = [samples[k : k + 16] for k in range(0, 48, 16)]
    with make_backend(tied_model_dir, tmp_path / "ckpt") as backend:
        await train(backend, batches[:1])
        path = await backend.save_checkpoint(1, {})
        straight = await train(backend, batches[1:])
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    with make_backend(tied_model_dir, tmp_path / "resumed") as fresh:
        await fresh.load_checkpoint(path)
        assert fresh.model.lm_head.weight is fresh.model.model.embed_tokens.weight
        assert await train(fresh, batches[1:]) == straight


async def test_a_checkpoint_with_the_model_inside_dcp_resumes_from_dcp(
    tiny_model_dir, tmp_path, samples
):
    """The layout written before the export became the one copy: the model is read from
    `dcp/` (the export beside it is ignored, here overwritten with zeros to show it)."""
    batches = [samples[k : k + 16] for k in range(0, 48, 16)]
    with make_backend(tiny_model_dir, tmp_path / "ckpt") as backend:
        await train(backend, batches[:1])
        path = await backend.save_checkpoint(1, {})
        st.save_sharded(backend.model, backend.optimizer, path / "dcp-old", None, with_model=True)
        straight = await train(backend, batches[1:])
    (path / DCP_DIR).rename(path / "dcp-new")
    (path / "dcp-old").rename(path / DCP_DIR)
    assert any(k.startswith("model.") for k in dcp_keys(path))
    zeros = {k: torch.zeros_like(v) for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(zeros, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert await resumed_losses(tiny_model_dir, path, tmp_path, batches[1:]) == straight


async def test_an_export_that_does_not_fit_the_model_is_a_clear_error(
    tiny_model_dir, tmp_path, samples
):
    with make_backend(tiny_model_dir, tmp_path / "ckpt") as backend:
        await train(backend, [samples[:8]])
        path = await backend.save_checkpoint(1, {})
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with (
        make_backend(tiny_model_dir, tmp_path / "other") as fresh,
        pytest.raises(CheckpointError, match=r"step_000001 do not match.*model\.norm\.weight"),
    ):
        await fresh.load_checkpoint(path)
    (path / "model.safetensors").unlink()
    with (
        make_backend(tiny_model_dir, tmp_path / "other2") as fresh,
        pytest.raises(CheckpointError, match=r"model\.safetens.* not found"),
    ):
        await fresh.load_checkpoint(path)
