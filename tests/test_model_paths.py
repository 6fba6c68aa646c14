"""One rule for model paths (plumbing/model_paths.py), the same in every entry point: a run
directory, its checkpoints/ directory, checkpoints/latest, a checkpoint (step_000004 or
step_4) and a plain HF model directory each name one concrete HF model directory; a path
that names none says why (no checkpoint yet, no config.json) instead of transformers'
tokenizer noise ("You need to have sentencepiece or tiktoken installed")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from plumbing.model_paths import resolve_model_dir
from rollouts.errors import ModelLoadError
from tests.test_cli import assert_error_only, rollouts, write_chats
from training.backend.checkpoint import write_checkpoint
from training.backend.model_io import load_model, load_tokenizer
from training.config import ModelConfig, load_config
from training.recipes.rl import resolve_start_model
from training.recipes.sft import resolve_model_path
from training.rl_config import RLRunConfig

LM_HEAD = "lm_head.weight"


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tiny_tokenizer, tmp_path_factory) -> Path:
    """A run directory as the trainer writes it: checkpoints step 2 and 4 (latest), whose
    output layers differ from the base model's (+1 and +2), so a load shows which it read."""
    model = load_model(tiny_model_dir)
    run = tmp_path_factory.mktemp("model_paths") / "run"
    for step in (2, 4):
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        write_checkpoint(run / "checkpoints", step, model=model, tokenizer=tiny_tokenizer,
                         torch_state={}, json_state={"step": step}, keep_last=None)  # fmt: skip
    return run


def forms_of(run: Path) -> list[Path]:
    ckpts = run / "checkpoints"
    return [run, ckpts, ckpts / "latest", ckpts / "step_000004", ckpts / "step_4"]


def test_every_form_of_a_run_names_its_latest_checkpoint(run_dir, tiny_model_dir, monkeypatch):
    latest = (run_dir / "checkpoints" / "step_000004").resolve()
    for form in forms_of(run_dir):
        assert Path(resolve_model_dir(form)).resolve() == latest, form
    monkeypatch.chdir(run_dir.parent)  # relative, as a user types them
    for form in forms_of(Path("run")):
        assert Path(resolve_model_dir(str(form))).resolve() == latest, form
    older = run_dir / "checkpoints" / "step_2"
    assert Path(resolve_model_dir(older)).resolve() == (older.parent / "step_000002").resolve()
    assert resolve_model_dir(tiny_model_dir) == str(tiny_model_dir)
    assert resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_each_entry_point_loads_the_latest_checkpoint_from_a_checkpoints_dir(
    run_dir, tiny_model_dir
):
    base = load_model(tiny_model_dir).state_dict()[LM_HEAD]
    for form in forms_of(run_dir):
        # load_model / load_tokenizer: what `rl_backend`, the critic and SFT's backend call
        torch.testing.assert_close(load_model(form).state_dict()[LM_HEAD], base + 2.0)
        assert load_tokenizer(form).encode("12+34") == load_tokenizer(tiny_model_dir).encode(
            "12+34"
        )
    latest = str(run_dir / "checkpoints" / "step_000004")
    ckpts = str(run_dir / "checkpoints")
    assert resolve_model_path(ModelConfig(path=ckpts)) == latest  # SFT's start model
    rl = load_config(RLRunConfig, None, [f"model.path={ckpts}"])
    assert trio.run(resolve_start_model, rl) == latest


@pytest.mark.parametrize("layout", ["empty_checkpoints", "run_without_checkpoint", "nothing"])
def test_a_path_without_a_model_names_the_cause_not_the_tokenizer(tmp_path, layout):
    run = tmp_path / "runs" / "x"
    (run / "checkpoints").mkdir(parents=True)
    path, cause = {
        "empty_checkpoints": (run / "checkpoints", f"{run / 'checkpoints'} has no checkpoint yet"),
        "run_without_checkpoint": (run, "the run has no checkpoint yet"),
        "nothing": (run.parent, f"no config.json in {run.parent}; expected an HF model"),
    }[layout]
    for load in (resolve_model_dir, load_tokenizer, load_model):
        with pytest.raises(ModelLoadError) as err:
            load(path)
        assert cause in str(err.value) and "sentencepiece" not in str(err.value)


def test_a_missing_dir_under_an_existing_folder_is_no_such_directory_not_a_hub_id(
    tmp_path, monkeypatch
):
    # issue 42's user typed `--model runs/nope`: one slash reads as `namespace/name`, so the hub
    # client retried for half a minute offline and said "couldn't connect"
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        resolve_model_dir("runs/nope")
    assert "runs/nope: no such directory" in str(err.value)
    assert resolve_model_dir("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # no Qwen/ here: a hub id


def test_the_cli_entry_points_name_the_cause_of_a_model_path_without_a_model(tmp_path):
    ckpts = tmp_path / "runs" / "x" / "checkpoints"
    ckpts.mkdir(parents=True)
    cause = f"{ckpts} has no checkpoint yet"
    rl = rollouts("rl", "--model", str(ckpts), "--output-dir", str(tmp_path / "o"), cwd=tmp_path)
    assert_error_only(rl, f"model.path (--model) {cause}")
    serve = rollouts("serve", "--model-path", str(ckpts), cwd=tmp_path)
    assert_error_only(serve, f"--model-path {cause}")
    sft = rollouts("sft", "--model", str(ckpts), "--output-dir", str(tmp_path / "o"), "--data",
                   str(write_chats(tmp_path / "d.jsonl", 4)), cwd=tmp_path)  # fmt: skip
    assert_error_only(sft, cause)
    for proc in (rl, serve, sft):
        assert "sentencepiece" not in proc.stderr
