"""Sample lengths come from the data: with `data.max_seq_len` null every record trains whole
(up to the model's context) and packed rows follow; an explicit cap still wins and is reported."""

import json
from pathlib import Path

import yaml
from transformers import AutoTokenizer

from tests.test_cli import ROOT, rollouts, sft_args
from training.config import SFTRunConfig, load_config
from training.data.sft_data import load_sft_jsonl
from training.data.tokenize import tokenize_records
from training.recipes.rl import sft_checkpoint_mismatch
from training.recipes.sft import resolve_lengths


def write_tool_chats(path: Path, n: int) -> Path:
    """Realistic records: short sums and, every fifth line, a long tool-call conversation."""
    rows = []
    for i in range(n):
        if i % 5:
            rows.append({"prompt": f"{i}+1", "completion": str(i + 1)})
            continue
        call = {"type": "function", "function": {"name": "calculator",
                                                 "arguments": {"expression": f"{i}*37"}}}  # fmt: skip
        rows.append({"messages": [
            {"role": "user", "content": f"What is {i}*37? Use the calculator."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": str(i * 37)},
            {"role": "assistant", "content": f"It is {i * 37}. " + "Here is why. " * 30},
        ]})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_without_max_seq_len_no_record_is_cut_and_the_longest_sets_the_length(
    tmp_path, tiny_model_dir
):
    data = write_tool_chats(tmp_path / "chats.jsonl", 20)
    config = yaml.safe_load((ROOT / "configs" / "sft_tiny.yaml").read_text())
    assert config["data"]["max_seq_len"] is None  # the README's config leaves it to the data
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples, _ = tokenize_records(load_sft_jsonl(data), tok, max_seq_len=10**6)
    longest = max(len(s) for s in samples)
    assert longest > 256  # the tool-call records: longer than any fixed default was

    proc = rollouts(*sft_args(tiny_model_dir, tmp_path, "--data", str(data), "--max-steps", "1",
                              "train.batch_size=4"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr
    assert "20 records → 20 samples" in proc.stderr and "truncated 0" in proc.stderr
    assert f"data.max_seq_len={longest} (the longest record), data.pack_length={longest}" in (
        proc.stderr
    )
    state = json.loads((tmp_path / "out" / "checkpoints" / "step_000001" / "trainer_state.json")
                       .read_text())["extra"]  # fmt: skip
    assert state["config"]["data"]["max_seq_len"] is None  # as given: the same config resumes
    assert state["data_lengths"]["max_seq_len"] == state["data_lengths"]["pack_length"] == longest
    same = load_config(SFTRunConfig, ROOT / "configs" / "sft_tiny.yaml", [
        f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'out'}", "train.max_steps=1",
        f"data.train_path={data}", "train.batch_size=4"])  # fmt: skip
    assert sft_checkpoint_mismatch(tmp_path / "out" / "checkpoints" / "step_000001", same) is None


def test_lengths_are_capped_by_the_context_and_an_explicit_max_seq_len_wins():
    default = SFTRunConfig()
    assert resolve_lengths(default, 40, 1024)[:2] == (40, 256)  # short rows still share rows
    assert resolve_lengths(default, 5000, 1024)[:2] == (1024, 1024)  # never past the context
    assert resolve_lengths(default, 700, None)[:2] == (700, 700)
    capped = SFTRunConfig.model_validate({"data": {"max_seq_len": 64}})
    assert resolve_lengths(capped, 700, 1024)[:2] == (64, 256)
    one_key = SFTRunConfig.model_validate({"data": {"max_seq_len": 2048}})
    assert resolve_lengths(one_key, 700, 1024)[:2] == (2048, 2048)  # pack_length follows
