"""Looking at a model's outputs from the command line: `rollouts generate` answers every prompt
of a prompts or chat file; `rollouts eval --show N` prints N scored samples; eval refuses
records it cannot score instead of reporting them as failures."""

import json
from dataclasses import replace
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


# ----- every file SFT and RL read; a prompt too long for the context is one record's problem ----

TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "a*b",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                          "b": {"type": "integer"}}}}}]  # fmt: skip


def tool_chat(i: int) -> dict:
    """A chat as the OpenAI format writes it: a tool call with null content and its arguments
    as a JSON string, the tool's answer, the final assistant turn."""
    call = {"id": f"c{i}", "type": "function",
            "function": {"name": "multiply", "arguments": json.dumps({"a": i, "b": 7})}}  # fmt: skip
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": f"what is {i} times 7?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": str(7 * i)},
        {"role": "assistant", "content": f"{7 * i}"}]}  # fmt: skip


def chat_tokens(tokenizer, messages, tools=None) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=False)  # fmt: skip
    return list(out)


def test_a_tool_chats_prompt_is_the_context_sft_trains_its_last_turn_on(tmp_path, tiny_tokenizer):
    from training.data.sft_data import load_sft_jsonl
    from training.data.tokenize import tokenize_conversation
    from training.recipes.prompt_files import load_prompt_file

    data = write_jsonl(tmp_path / "tools.jsonl", [tool_chat(i) for i in range(3)])
    prompts, stats = load_prompt_file(data, tiny_tokenizer, expected_key="expected")
    assert stats.n_kept == 3 and stats.n_skipped == 0
    for prompt, record in zip(prompts, load_sft_jsonl(data), strict=True):
        sft = tokenize_conversation(tiny_tokenizer, record.messages, record.tools)
        last_turn = max(i for i in range(1, len(sft)) if sft.loss_mask[i] and
                        not sft.loss_mask[i - 1])  # fmt: skip
        assert list(prompt.prompt_ids) == list(sft.input_ids[:last_turn])
        assert prompt.metadata["expected"] == record.messages[-1]["content"]
        assert [m["role"] for m in prompt.messages] == ["user", "assistant", "tool"]


def test_a_prompt_over_the_limit_is_skipped_or_cut_with_a_warning_naming_its_line(
    tmp_path, tiny_tokenizer, caplog
):
    from training.recipes.prompt_files import load_prompt_file

    rows = [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(4)]
    rows[2] = {"prompt": "1" * 300, "answer": "x"}
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    full = chat_tokens(tiny_tokenizer, [{"role": "user", "content": "1" * 300}])
    with caplog.at_level("WARNING", logger="rollouts.prompt_files"):
        kept, stats = load_prompt_file(data, tiny_tokenizer, max_prompt_len=100)
    assert [p.source for p in kept] == [f"{data}:1", f"{data}:2", f"{data}:4"]
    assert (stats.n_records, stats.n_skipped, stats.n_truncated) == (4, 1, 0)
    warned = [r.getMessage() for r in caplog.records]
    assert f"{data}:3: prompt is {len(full)} tokens, longer than the limit of 100" in warned[0]
    assert f"{data}: 4 records → 3 prompts; 1 skipped" in warned[-1]
    cut, stats = load_prompt_file(data, tiny_tokenizer, max_prompt_len=100, overlong="truncate")
    assert list(cut[2].prompt_ids) == full[-100:] and stats.n_truncated == 1


def test_generate_answers_a_users_tool_chat_file_from_a_run_dir_skipping_the_overlong_record(
    tmp_path, tiny_model_dir, tiny_tokenizer
):
    """Issue 42: `generate` refused tool-call turns SFT accepts, took only some model paths,
    and a 1,037-token prompt aborted the run without naming its record."""
    import torch

    from training.backend.checkpoint import write_checkpoint
    from training.backend.model_io import load_model

    run = tmp_path / "runs" / "x"
    write_checkpoint(run / "checkpoints", 3, model=load_model(tiny_model_dir),
                     tokenizer=tiny_tokenizer, torch_state={"rng": torch.zeros(1)},
                     json_state={"step": 3}, keep_last=None)  # fmt: skip
    long = [{"role": "user", "content": "1" * 1029}]
    n_long = len(chat_tokens(tiny_tokenizer, long))
    assert n_long == 1037  # the record; the tiny model's context is 1024
    rows = [tool_chat(3), {"prompt": "7+1", "completion": "8"}, {"messages": long},
            {"prompt": "2+2", "answer": "4"}]  # fmt: skip
    data = write_jsonl(tmp_path / "mine.jsonl", rows)
    proc = rollouts("generate", "--model", str(run), "--data", str(data), "--max-new-tokens", "4",
                    cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"{data}:3: prompt is 1037 tokens, longer than the limit of 1019 (the model's context "
            "of 1024 tokens less --max-new-tokens 4): skipped") in proc.stderr  # fmt: skip
    assert f"{data}: 4 records → 3 prompts; 1 skipped" in proc.stderr
    # ours names the record; transformers' "indexing errors" warning about the same prompt misled
    assert "Token indices" not in proc.stderr and "indexing errors" not in proc.stderr
    shown = blocks(proc.stdout)
    assert [b.splitlines()[0] for b in shown] == [f"{i}: {data}:{line}" for i, line in
                                                   ((1, 1), (2, 2), (3, 4))]  # fmt: skip
    assert shown[0].splitlines()[1:4:2] == ["prompt:   21", "expected: 21"]  # the tool's answer
    assert shown[1].splitlines()[3] == "expected: 8" and shown[2].splitlines()[3] == "expected: 4"


async def test_a_prompt_the_engine_refuses_is_one_missing_answer_with_a_warning(
    local_engine, tiny_tokenizer, caplog
):
    """A served model with a shorter context than the model's config (an --engine-url) refuses
    a prompt the loader let through: that record gets no answer, the others still do."""
    from rollouts.prompts import prompt_item
    from training.recipes.generate import generate_answers

    _, engine = local_engine
    short = prompt_item(tiny_tokenizer, [{"role": "user", "content": "2+2"}])
    too_long = prompt_item(tiny_tokenizer, [{"role": "user", "content": "1" * 1029}])
    prompts = [short, replace(too_long, source="mine.jsonl:2"), short]
    with caplog.at_level("WARNING", logger="rollouts.generate"):
        answers = await generate_answers(engine, prompts, max_new_tokens=2)
    assert answers[1] is None and answers[0] is not None and answers[2] is not None
    assert any(r.getMessage().startswith("mine.jsonl:2: the engine refused this prompt")
               for r in caplog.records)  # fmt: skip
