"""A copy of the tiny model with tied input and output embeddings (the tiny model is untied;
Qwen2.5-0.5B, the GPU check's shape, is tied): for the tests of what changes with FSDP units
and attention kernels, where a tied weight is one parameter used at both ends."""

from __future__ import annotations

import shutil
from pathlib import Path


def tied_copy(model_dir: Path | str, out: Path) -> Path:
    """`out` holding the tiny model's config with `tie_word_embeddings`, random weights (seed 0),
    and its tokenizer files; built once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(out)
    for f in Path(model_dir).iterdir():
        if "token" in f.name or f.name.endswith((".jinja", "vocab.json", "merges.txt")):
            shutil.copy(f, out / f.name)
    return out
