"""Looking at a model's outputs from the command line: `rollouts generate` answers every prompt
of a prompts or chat file; `rollouts eval --show N` prints N scored samples; eval refuses
records it cannot score instead of reporting them as failures."""

import json
from pathlib import Path

from tests.test_cli import assert_error_only, rollouts


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def blocks(stdout: str) -> list[str]:
    return [b for b in stdout.split("--- ")[1:]]


def test_eval_on_records_without_the_answer_exits_2_naming_file_line_and_field(
    tmp_path, tiny_model_dir
):
    rows = [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(3)]
    rows[1] = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    proc = rollouts("eval", "--model", str(tiny_model_dir), "--data", str(data), cwd=tmp_path)
    assert_error_only(proc, f"{data}:2: answer: missing (1 of 3 records)", "rollouts generate")
    assert "launching engine" not in proc.stderr  # refused before any engine starts


def test_generate_prints_one_answer_per_prompt_of_a_chat_file(tmp_path, tiny_model_dir):
    chat = [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"reference {i}"}]} for i in range(4)]  # fmt: skip
    chat.append({"prompt": "7+1", "completion": "8"})
    data = write_jsonl(tmp_path / "sft.jsonl", chat)
    proc = rollouts("generate", "--model", str(tiny_model_dir), "--data", str(data),
                    "--max-new-tokens", "4", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = blocks(proc.stdout)
    assert len(shown) == 5
    for i, block in enumerate(shown[:4]):
        lines = block.splitlines()
        assert lines[0] == f"{i + 1}: {data}:{i + 1}"
        assert lines[1] == f"prompt:   question {i}" and lines[2].startswith("answer:   ")
        assert lines[3] == f"expected: reference {i}"  # the record's own turn, not a prompt
    assert shown[4].splitlines()[1:4:2] == ["prompt:   7+1", "expected: 8"]


def test_eval_show_prints_n_samples_with_prompt_answer_expected_and_score(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(5)]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    proc = rollouts("eval", "--model", str(tiny_model_dir), "--data", str(data), "--show", "2",
                    cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    *samples, metrics = proc.stdout.splitlines()
    shown = blocks("\n".join(samples))
    assert len(shown) == 2
    for i, block in enumerate(shown):
        keys = [line.split(":")[0] for line in block.splitlines()[1:]]
        assert keys == ["prompt", "answer", "expected", "score"]
        assert f"expected: {i + 1}" in block and "reward=" in block
    assert "n_prompts=5" in metrics
