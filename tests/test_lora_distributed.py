"""LoRA under FSDP2 (two gloo processes) against one process, for real.

The properties: the adapter's gradient under 2 ranks is the one-process gradient (SFT and
GRPO), and an SFT run with LoRA checkpointed by 2 ranks resumes in 1 process with the losses
of a straight run; the adapter rank 0 gathered loads in peft, and the merged model rank 0
rebuilt computes the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed_launch import ROOT, launch
from tests.warm_python import shared

pytestmark = pytest.mark.slow  # three process launches besides the shared gradient runs

MODES = ("sft-lora", "grpo-token-mean-lora")


@pytest.mark.parametrize("mode", MODES)
def test_two_process_adapter_gradient_equals_the_one_process_gradient(distributed_grads, mode):
    grads = distributed_grads
    one = load_file(str(grads / "w1" / mode / "grads.safetensors"))
    two = load_file(str(grads / "w2" / mode / "grads.safetensors"))
    assert one.keys() == two.keys() and len(one) > 10
    assert all(".lora_A." in name or ".lora_B." in name for name in one)  # the base is frozen
    for name, g in one.items():
        assert g.abs().max() > 0, name  # B ≠ 0 after the first step, so A has a gradient too
        # Compared after one AdamW step (taken by each world size on its own rounding of the
        # first gradient), hence 1e-4 rather than the 1e-5 of the full-model first step.
        assert ((two[name] - g).abs().max() / g.abs().max()).item() < 1e-4, name
    m1 = json.loads((grads / "w1" / mode / "metrics.json").read_text())
    m2 = json.loads((grads / "w2" / mode / "metrics.json").read_text())
    assert m2["n_trained_tokens"] == m1["n_trained_tokens"]
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)


def sft(world: int, out: Path, steps: int, *extra: str) -> dict[int, float]:
    """The SFT recipe at `world` ranks, forked from the warm interpreter with torchrun's
    variables (tests/warm_python.py): what is checked is what the ranks write; torchrun itself
    is tested by tests/test_distributed.py, test_two_nodes.py and test_torchrun_exit.py."""
    proc = launch("examples/run_sft.py", "--config", str(ROOT / "configs" / "sft_tiny.yaml"),
                  "--output-dir", str(out), "--max-steps", str(steps), "train.log_every=1",
                  "train.eval_every=1000", "train.checkpoint_every=2", "train.eval_samples=16",
                  "train.greedy_eval_samples=0", "backend.num_threads=1", "train.batch_size=16",
                  "model.lora.rank=4", "optim.lr=1e-2", "data.arithmetic.n_sft=400",
                  "data.arithmetic.n_eval=50", *extra, world=world, cwd=out.parent,
                  warm=shared())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").open())}


def test_a_lora_run_checkpointed_by_two_ranks_resumes_in_one(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, data = f"model.path={tiny_model_dir}", f"data.task_dir={tmp_path / 'data'}"
    straight = sft(1, tmp_path / "one", 4, model, data)
    mixed = sft(2, tmp_path / "mixed", 2, model, data, "model.lora.merged_export=true")
    mixed |= sft(1, tmp_path / "mixed", 4, model, data, "--resume")
    assert sorted(mixed) == sorted(straight) == [1, 2, 3, 4]
    for step, loss in straight.items():
        assert mixed[step] == pytest.approx(loss, rel=1e-4), step
    assert straight[4] < straight[1]

    by_two = tmp_path / "mixed" / "checkpoints" / "step_000002"
    assert not (by_two / "model.safetensors").exists()
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                            by_two).eval()(input_ids=ids).logits  # fmt: skip
        merged = AutoModelForCausalLM.from_pretrained(by_two / "merged").eval()(input_ids=ids)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged.logits, adapted, rtol=0, atol=1e-5)
    assert (adapted - base).abs().max() > 1e-4  # two steps moved the adapter
