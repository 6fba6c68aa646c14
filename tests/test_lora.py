"""LoRA training (peft) on the real tiny model: optimizer, adapter files, merged export, resume.

Properties: only the adapter's parameters train; a checkpoint holds the adapter in peft's
layout, which `PeftModel.from_pretrained(base, dir)` loads to the trained model's logits; the
merged export computes the same function; the base model (adapters off) is the model the run
started from; resume continues the loss curve exactly; bad `model.lora` values are refused
naming the field.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from rollouts.errors import ConfigError, ModelLoadError
from rollouts.tasks.arithmetic import make_problems
from training.backend.checkpoint import find_latest_checkpoint
from training.backend.lora import MERGED_DIR, loadable_model_dir
from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
from training.config import LoraSettings, OptimConfig, SFTLoopConfig, SFTRunConfig, load_config
from training.data.buffer import DataBuffer
from training.data.tokenize import tokenize_conversation
from training.loops.sft import SFTData, run_sft_training
from training.rl_config import RLRunConfig


@pytest.fixture(scope="module")
def samples(tiny_tokenizer):
    problems = make_problems(120, seed=11, min_digits=1, max_digits=2)
    return [tokenize_conversation(tiny_tokenizer, p.sft_record()["messages"]) for p in problems]


def lora_backend(model_dir, out, *, max_steps=20, **lora):
    settings = LoraSettings(rank=lora.pop("rank", 4), **lora)
    return PyTorchTrainingBackend(
        partial(load_model, str(model_dir)), load_tokenizer(model_dir),
        optim=OptimConfig(lr=5e-3, warmup_steps=2), max_steps=max_steps,
        checkpoint_dir=out / "checkpoints", micro_batch_tokens=256, pack_length=128,
        lora=settings,
    )  # fmt: skip


async def train(backend, samples, steps):
    for k in range(steps):
        await backend.forward_backward(samples[8 * k : 8 * k + 8]).result()
        await backend.optim_step().result()


def logits_of(model, samples):
    n = min(len(s.input_ids) for s in samples[:4])
    ids = torch.tensor([list(s.input_ids[:n]) for s in samples[:4]])
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_only_adapter_parameters_reach_the_optimizer(tiny_model_dir, tmp_path):
    with lora_backend(tiny_model_dir, tmp_path) as backend:
        in_optimizer = [p for g in backend.optimizer.param_groups for p in g["params"]]
        adapter = [p for n, p in backend.model.named_parameters() if "lora_" in n]
        every = list(backend.model.parameters())
    assert adapter and {id(p) for p in in_optimizer} == {id(p) for p in adapter}
    assert sum(p.numel() for p in in_optimizer) == sum(p.numel() for p in adapter)
    assert sum(p.numel() for p in adapter) < 0.05 * sum(p.numel() for p in every)
    assert all(not p.requires_grad for n, p in backend.model.named_parameters() if "lora_" not in n)


async def test_checkpoint_adapter_loads_in_peft_with_the_trained_logits(
    tiny_model_dir, tmp_path, samples
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with lora_backend(tiny_model_dir, tmp_path) as backend:
        await train(backend, samples, 3)
        path = await backend.save_checkpoint(3, {})
        trained = logits_of(backend.model, samples)
        base_params = {
            n: p.clone() for n, p in backend.model.named_parameters() if "lora_" not in n
        }
    assert (path / "adapter_model.safetensors").is_file()
    assert (path / "adapter_config.json").is_file()
    assert not (path / "model.safetensors").exists() and not (path / MERGED_DIR).exists()
    dcp_bytes = sum(f.stat().st_size for f in (path / "dcp").rglob("*") if f.is_file())
    model_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert dcp_bytes < model_bytes / 4  # adapter + its optimizer state, no base weights

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = PeftModel.from_pretrained(base, path)
    torch.testing.assert_close(logits_of(loaded, samples), trained, rtol=0, atol=1e-5)
    untrained = logits_of(AutoModelForCausalLM.from_pretrained(tiny_model_dir), samples)
    assert (untrained - trained).abs().max() > 1e-3  # the adapter did change the function
    for name, p in loaded.named_parameters():  # the base stayed the base
        if "lora_" not in name:
            assert torch.equal(p, base_params[name]), name


async def test_an_adapter_trained_from_a_relative_path_loads_by_itself_from_another_cwd(
    tiny_model_dir, tmp_path, samples, monkeypatch
):
    """`AutoPeftModelForCausalLM.from_pretrained(adapter_dir)` reads the base model from the
    adapter's `base_model_name_or_path`: a relative one (the path as typed) sent peft to the
    hub from any other directory ("couldn't connect")."""
    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(tiny_model_dir.parent)
    with lora_backend(Path(tiny_model_dir.name), tmp_path) as backend:  # as a user types it
        await train(backend, samples, 2)
        path = await backend.save_checkpoint(2, {})
        trained = logits_of(backend.model, samples)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    saved = json.loads((path / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    loaded = AutoPeftModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(logits_of(loaded, samples), trained, rtol=0, atol=1e-5)


async def test_merged_export_computes_the_adapter_models_logits(tiny_model_dir, tmp_path, samples):
    from transformers import AutoModelForCausalLM

    with lora_backend(tiny_model_dir, tmp_path, merged_export=True) as backend:
        await train(backend, samples, 2)
        path = await backend.save_checkpoint(2, {})
        trained = logits_of(backend.model, samples)
        await train(backend, samples[16:], 1)  # the training model kept its adapters (unmerged)
        assert any("lora_" in n for n, _ in backend.model.named_parameters())
    merged = AutoModelForCausalLM.from_pretrained(loadable_model_dir(path))
    assert loadable_model_dir(path) == path / MERGED_DIR
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits_of(merged, samples), trained, rtol=0, atol=1e-5)


async def test_a_lora_checkpoint_without_a_merged_model_is_no_start_model(
    tiny_model_dir, tmp_path, samples
):
    with lora_backend(tiny_model_dir, tmp_path) as backend:
        await train(backend, samples, 1)
        path = await backend.save_checkpoint(1, {})
    with pytest.raises(ModelLoadError, match="merged_export"):
        loadable_model_dir(path)


async def test_weight_push_exports_only_the_adapter(tiny_model_dir, tmp_path, samples):
    with lora_backend(tiny_model_dir, tmp_path) as backend:
        await train(backend, samples, 1)
        out = await backend.export_weights(tmp_path / "push" / "v000001")
    files = {f.name: f.stat().st_size for f in out.iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    model_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert sum(files.values()) < model_bytes / 10


async def test_base_model_logprobs_are_the_untrained_models(tiny_model_dir, tmp_path, samples):
    """Adapters off = the model the run started from, before and after training; at step 0
    (LoRA's B = 0) the policy itself equals it exactly."""
    tok = load_tokenizer(tiny_model_dir)
    plain = PyTorchTrainingBackend(partial(load_model, str(tiny_model_dir)), tok,
                                   optim=OptimConfig(), max_steps=1, frozen=True,
                                   checkpoint_dir=tmp_path / "plain", pack_length=128)  # fmt: skip
    with plain, lora_backend(tiny_model_dir, tmp_path) as backend:
        probe = samples[100:110]
        want = await plain.compute_logprobs(probe, temperature=0.7).result()
        at_start = await backend.compute_logprobs(probe, temperature=0.7).result()
        await train(backend, samples, 3)
        policy = await backend.compute_logprobs(probe, temperature=0.7).result()
        base = await backend.compute_logprobs(probe, temperature=0.7, base_model=True).result()
    for w, s, b in zip(want, at_start, base, strict=True):
        assert torch.equal(s, w)
        torch.testing.assert_close(b, w, rtol=0, atol=1e-6)
    assert max((p - w).abs().max().item() for w, p in zip(want, policy, strict=True)) > 1e-3


async def run_sft(model_dir, out, samples, *, max_steps):
    config = SFTLoopConfig(batch_size=8, max_steps=max_steps, eval_every=4, eval_samples=8,
                           checkpoint_every=4, resume="auto")  # fmt: skip
    data = SFTData(DataBuffer(samples[:96], seed=3), tuple(samples[96:104]))
    with lora_backend(model_dir, out, max_steps=8) as backend:
        history = await run_sft_training(backend, data, config)
        adapter = {n: p.clone() for n, p in backend.model.named_parameters() if "lora_" in n}
    return history, adapter


async def test_resume_with_lora_continues_the_loss_curve_exactly(tiny_model_dir, tmp_path, samples):
    straight, w_straight = await run_sft(tiny_model_dir, tmp_path / "a", samples, max_steps=8)
    first, _ = await run_sft(tiny_model_dir, tmp_path / "b", samples, max_steps=4)
    second, w_resumed = await run_sft(tiny_model_dir, tmp_path / "b", samples, max_steps=8)
    assert len(first) == 4 and len(second) == 4
    losses = [m["loss"] for m in straight]
    assert [m["loss"] for m in first + second] == pytest.approx(losses, abs=1e-6)
    assert [m["lr"] for m in first + second] == pytest.approx([m["lr"] for m in straight])
    for name, p in w_straight.items():
        torch.testing.assert_close(w_resumed[name], p, rtol=0, atol=1e-6)
    assert losses[-1] < losses[0]
    assert find_latest_checkpoint(tmp_path / "b" / "checkpoints").name == "step_000008"


# ----- config ----------------------------------------------------------------------------------


def test_the_dotted_override_creates_the_lora_section(tmp_path):
    cfg = load_config(RLRunConfig, "configs/rl_tiny.yaml", ["model.lora.rank=8"])
    assert cfg.model.lora == LoraSettings(rank=8, alpha=16.0)
    assert cfg.model.lora.target_modules == "all-linear" and cfg.model.lora.keep == 2
    assert load_config(SFTRunConfig, "configs/sft_tiny.yaml").model.lora is None
    nulled = tmp_path / "c.yaml"
    nulled.write_text("model:\n  lora: null\n")
    cfg = load_config(SFTRunConfig, nulled, ["model.lora.rank=2", "model.lora.alpha=3"])
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (2, 3.0)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("model.lora.rank=0", "model.lora.rank"),
        ("model.lora.rank=two", "model.lora.rank"),
        ("model.lora.alpha=-1", "model.lora.alpha"),
        ("model.lora.dropout=1.0", "model.lora.dropout"),
        ("model.lora.target_modules=[]", "model.lora.target_modules"),
        ("model.lora.target_modules=everything", "model.lora.target_modules"),
        ("model.lora.name=a/b", "model.lora.name"),
        ("model.lora.keep=0", "model.lora.keep"),
        ("model.lora.rnak=4", "model.lora.rnak"),
    ],
)
def test_bad_lora_values_are_refused_naming_the_field(override, field):
    overrides = [override] if override.startswith("model.lora.rank=") else ["model.lora.rank=4",
                                                                          override]  # fmt: skip
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(SFTRunConfig, "configs/sft_tiny.yaml", overrides)


def test_a_lora_section_without_a_rank_is_refused():
    with pytest.raises(ConfigError, match=r"model\.lora\.rank: Field required"):
        load_config(RLRunConfig, "configs/rl_tiny.yaml", ["model.lora.alpha=4"])
