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
