"""The calculator tool-use task: deterministic files, a disjoint held-out split, ideal traces."""

from __future__ import annotations

import json

from rollouts.tasks.multiply import make_problems, write_multiply_datasets
from training.data.tokenize import tokenize_conversation


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_files_are_deterministic_and_held_out_is_disjoint(tmp_path):
    a = write_multiply_datasets(tmp_path / "a", n_sft=50, n_rl=50, n_eval=20)
    b = write_multiply_datasets(tmp_path / "b", n_sft=50, n_rl=50, n_eval=20)
    assert a.rl_train.read_text() == b.rl_train.read_text()
    held = {r["messages"][0]["content"] for r in read(a.rl_eval)}
    train = {r["messages"][0]["content"] for r in read(a.rl_train) + read(a.sft_train)}
    assert len(held) == 20 and not held & train
    for record in read(a.rl_eval):
        x, y = record["messages"][0]["content"].split("*")
        assert int(record["answer"]) == int(x) * int(y) and 100 <= int(x) < 10_000


def test_trace_trains_only_the_call_and_the_answer(tiny_tokenizer):
    problem = make_problems(1, seed=3)[0]
    record = problem.sft_record()
    sample = tokenize_conversation(tiny_tokenizer, record["messages"])
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    text = tiny_tokenizer.decode(trained)
    assert f'"expression": "{problem.expression}"' in text
    assert text.endswith(f"{problem.answer}<|im_end|>")
    assert "tool\n" not in text  # the tool's turn is context, not a target
