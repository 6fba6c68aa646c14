"""examples/run_sft.py as a user runs it: errors before training, and a short real run."""

import json
import subprocess
from pathlib import Path

from tests import warm_python

ROOT = Path(__file__).parent.parent


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python examples/run_sft.py ARGS`, forked from the warm interpreter (tests/warm_python.py)."""
    return warm_python.run([ROOT / "examples" / "run_sft.py", *args], cwd=cwd, timeout=300)


def test_malformed_jsonl_fails_before_training_naming_line_and_field(tmp_path, tiny_model_dir):
    data = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}
    data.write_text(
        json.dumps(good) + "\n\n"
        + '{"messages": [{"role": "bot", "content": "x"}]}\n'
        + "{not json\n"
    )  # fmt: skip
    proc = run_cli(
        "--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--data", str(data),
        "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "out"), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "bad.jsonl:3" in proc.stderr and "role" in proc.stderr
    assert "bad.jsonl:4" in proc.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_unknown_override_is_named(tmp_path):
    proc = run_cli("--config", str(ROOT / "configs" / "sft_tiny.yaml"), "optim.lrr=1", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown key 'optim.lrr'" in proc.stderr


def test_short_run_on_user_data_prints_summary_and_checkpoint(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{i}+1", "completion": str(i + 1)} for i in range(40)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = run_cli(
        "--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--data", str(data),
        "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "out"),
        "--max-steps", "3", "train.batch_size=8", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("SFT done: steps=3 ") and "checkpoint=" in last
    ckpt = Path(last.split("checkpoint=")[1])
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer.json").is_file()
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["step"] for m in metrics] == [1, 2, 3]


def write_with_long_lines(path: Path, n: int, long: dict[int, str]) -> Path:
    """`n` short prompt/completion lines; line k in `long` gets a question ("q": the answer is
    cut off) or an answer ("a": its start stays) long enough to pass the tiny model's context."""
    rows = []
    for i in range(1, n + 1):
        prompt, completion = f"{i}+1", str(i + 1)
        if long.get(i) == "q":
            prompt = "1" * (1100 + i)
        elif long.get(i) == "a":
            completion = "a " * (1100 + i)
        rows.append({"prompt": prompt, "completion": completion})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_records_cut_or_dropped_are_named_once_and_reported_in_full(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from training.backend.checkpoint import checkpoint_step, find_latest_checkpoint
    from training.config import SFTRunConfig, load_config
    from training.data.sft_data import load_sft_jsonl
    from training.data.tokenize import tokenize_conversation
    from training.recipes.rl import sft_checkpoint_mismatch

    long = {2: "q", 3: "a", 5: "q", 7: "q", 8: "a", 11: "q", 12: "q"}
    train = write_with_long_lines(tmp_path / "train.jsonl", 16, long)
    held = write_with_long_lines(tmp_path / "held.jsonl", 4, {4: "q"})
    report = tmp_path / "report" / "cut.jsonl"
    proc = run_cli(
        "--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--data", str(train),
        "--eval-data", str(held), "--model", str(tiny_model_dir), "--output-dir",
        str(tmp_path / "out"), "--epochs", "1", "--data-report", str(report),
        "train.batch_size=8", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    lengths = {r.source: len(tokenize_conversation(tok, r.messages))
               for path in (train, held) for r in load_sft_jsonl(path)}  # fmt: skip
    expected = [
        (f"{path}:{k}", "cut" if how == "a" else "no trained tokens left")
        for path, longs in ((train, long), (held, {4: "q"}))
        for k, how in longs.items()
    ]
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["source"], r["what"]) for r in rows] == expected
    assert all(r["limit"] == 1024 and r["tokens"] == lengths[r["source"]]
               and r["tokens_cut"] == r["tokens"] - 1024 for r in rows)  # fmt: skip

    warnings = [line for line in proc.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, warnings
    assert "8 of 20 records were cut or dropped (2 cut, 6 dropped)" in warnings[0]
    first = [f"{r['source']} (tokens {r['tokens']}, limit 1024" for r in rows[:5]]
    assert all(f in warnings[0] for f in first) and "and 3 more" in warnings[0]
    assert str(report) in warnings[0]
    assert "train.jsonl: 16 records → 11 samples" in proc.stderr
    assert "truncated 2" in proc.stderr and "dropped 5 over-long" in proc.stderr
    # we measure lengths ourselves: transformers' warning about them would mislead
    assert "indexing errors" not in proc.stderr and "Token indices" not in proc.stderr

    steps = 2  # 11 records in batches of 8: --epochs 1 replaced the config's max_steps=800
    assert f"training 1 epoch = {steps} steps over 11 records" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith(f"SFT done: steps={steps} ")
    # RL starting from this recipe (sft_config) sees its checkpoint as finished, not unfinished
    same = load_config(SFTRunConfig, ROOT / "configs" / "sft_tiny.yaml", [
        f"data.train_path={train}", f"data.eval_path={held}", f"model.path={tiny_model_dir}",
        f"output_dir={tmp_path / 'out'}", "train.epochs=1", "train.max_steps=null",
        f"data.report_path={report}", "train.batch_size=8"])  # fmt: skip
    latest = find_latest_checkpoint(tmp_path / "out" / "checkpoints")
    assert checkpoint_step(latest) == steps and sft_checkpoint_mismatch(latest, same) is None


def test_max_steps_and_epochs_together_are_refused_naming_both(tmp_path):
    proc = run_cli("--config", str(ROOT / "configs" / "sft_tiny.yaml"), "train.epochs=2",
                   cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert "train.max_steps=800 and train.epochs=2 both set the run's length" in proc.stderr
    proc = run_cli("--epochs", "2", "--max-steps", "5", cwd=tmp_path)
    assert proc.returncode == 2 and "--epochs and --max-steps" in proc.stderr
