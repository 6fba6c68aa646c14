from pathlib import Path

import pytest

from rollouts.errors import ConfigError
from training.config import SFTRunConfig, apply_overrides, load_config

CONFIGS = Path(__file__).parent.parent / "configs"


def test_shipped_sft_config_loads():
    config = load_config(SFTRunConfig, CONFIGS / "sft_tiny.yaml")
    assert config.data.packing and config.train.max_steps > 0


def test_dotted_overrides_are_typed():
    config = load_config(
        SFTRunConfig, CONFIGS / "sft_tiny.yaml", ["optim.lr=5e-4", "data.packing=false"]
    )
    assert config.optim.lr == 5e-4 and config.data.packing is False


def test_unknown_key_in_file_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  lr: 1e-3\n  learning_rat: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*unknown key 'optim.learning_rat'"):
        load_config(SFTRunConfig, path)


def test_bad_value_names_key_and_value():
    with pytest.raises(ConfigError, match=r"train.batch_size.*-3"):
        load_config(SFTRunConfig, None, ["train.batch_size=-3"])


def test_unknown_override_key_is_named():
    with pytest.raises(ConfigError, match="unknown key 'train.max_stepz'"):
        load_config(SFTRunConfig, None, ["train.max_stepz=3"])


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides({}, ["train.max_steps"])


def test_config_is_frozen():
    config = load_config(SFTRunConfig)
    with pytest.raises(Exception, match="frozen"):
        config.output_dir = "x"  # type: ignore[misc]


def test_an_nccl_weight_group_with_the_trainer_and_launched_engines_on_one_gpu_is_refused():
    # NCCL refuses two ranks of a group on one GPU ("Duplicate GPU detected"): the push would
    # fail at its first broadcast on the GPU machine, after the engines started
    from training.rl_config import RLRunConfig

    gpu = ["engines.weight_transport=distributed", "engines.weight_group_backend=nccl",
           "engines.local_device=cuda"]  # fmt: skip
    for trainer in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=r"NCCL refuses two ranks of one group on one GPU"):
            load_config(RLRunConfig, None, [*gpu, f"backend.device={trainer}"])
    for fine in (["engines.weight_group_backend=gloo"], ["backend.device=cuda:1"],
                 ["engines.urls=[http://h:30000]"]):  # fmt: skip
        load_config(RLRunConfig, None, [*gpu, "backend.device=cuda", *fine])


def test_distributed_weight_transport_with_lora_is_refused_saying_adapters_use_disk():
    from training.rl_config import RLRunConfig

    config = load_config(RLRunConfig, None, ["engines.weight_transport=distributed"])
    assert config.engines.weight_transport == "distributed"
    with pytest.raises(ConfigError, match=r"LoRA adapters are pushed through disk"):
        load_config(RLRunConfig, None, ["engines.weight_transport=distributed",
                                        "model.lora.rank=8"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"broadcast speaks SGLang's refit routes"):
        load_config(RLRunConfig, None, ["engines.weight_transport=distributed",
                                        "engines.kind=vllm", "engines.urls=[http://h:8000]"])  # fmt: skip


# ----- unknown keys: where, and what was meant (training/config_hints.py) ---------------------


def test_a_trl_key_in_a_yaml_names_its_line_and_the_rollouts_key(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("# from TRL\noutput_dir: runs/x\nlearning_rate: 1.0e-6\nuse_vllm: true\n")
    with pytest.raises(ConfigError) as err:
        load_config(SFTRunConfig, path)
    lines = str(err.value).splitlines()[1:]
    assert lines[0].strip() == (
        f"{path}:3: unknown key 'learning_rate'; rollouts calls it 'optim.lr' (docs/from-trl.md)"
    )
    assert lines[1].strip() == f"{path}:4: unknown key 'use_vllm'"  # GRPO's name: no SFT meaning
    from training.rl_config import RLRunConfig

    with pytest.raises(ConfigError, match=rf"{path}:4: unknown key 'use_vllm'; rollouts calls it "
                                          r"'engines.kind'"):  # fmt: skip
        load_config(RLRunConfig, path)


def test_a_trl_key_as_an_override_names_the_override_and_the_trainers_meaning():
    from training.rl_config import RLRunConfig

    with pytest.raises(ConfigError) as err:
        load_config(RLRunConfig, CONFIGS / "rl_tiny.yaml", ["beta=0.04", "num_train_epochs=2"])
    text = str(err.value)
    assert ("override 'beta=0.04': unknown key 'beta'; rollouts calls it "
            "'algorithm.overrides.kl_coef' (GRPOConfig; ") in text  # fmt: skip
    assert "'algorithm.overrides.dpo_beta' (OnlineDPOConfig; " in text
    assert ("override 'num_train_epochs=2': unknown key 'num_train_epochs'; TRL's "
            "GRPOConfig.num_train_epochs has no rollouts equivalent: ") in text  # fmt: skip
    # the same TRL name means an SFT key in an SFT config
    with pytest.raises(ConfigError, match=r"'num_train_epochs'; rollouts calls it 'train.epochs'"):
        load_config(SFTRunConfig, None, ["num_train_epochs=2"])


def test_a_misspelt_key_suggests_the_nearest_key_of_the_config(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("train:\n  batch_size: 4\n  max_stepz: 3\n  lr: 1\nlr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(SFTRunConfig, path, ["optim.lrr=1", "logging.tensorboard.path=tb"])
    lines = [line.strip() for line in str(err.value).splitlines()[1:]]
    assert sorted(lines) == sorted([
        f"{path}:3: unknown key 'train.max_stepz'; did you mean 'train.max_steps'?",
        f"{path}:4: unknown key 'train.lr'; did you mean 'optim.lr'?",
        f"{path}:5: unknown key 'lr'; did you mean 'optim.lr'?",
        "override 'optim.lrr=1': unknown key 'optim.lrr'; did you mean 'optim.lr'?",
        "override 'logging.tensorboard.path=tb': unknown key 'logging.tensorboard.path'; "
        "did you mean 'logging.tensorboard.dir'?",
    ])  # fmt: skip


def test_a_bad_value_names_its_file_line_and_the_trl_meaning_of_the_key(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text("output_dir: out\noptim: adamw_torch\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: optim: .*'adamw_torch'.*rollouts calls "
                                          r"it 'optim.name'"):  # fmt: skip
        load_config(SFTRunConfig, path)


def test_a_key_far_from_every_config_key_gets_no_guess():
    with pytest.raises(ConfigError) as err:
        load_config(SFTRunConfig, None, ["zzz.qqq=1"])
    assert str(err.value).splitlines()[1].strip() == "override 'zzz.qqq=1': unknown key 'zzz'"


def test_every_rollouts_key_the_trl_table_names_exists_in_the_config_models():
    # Checked through validation itself: a key that exists is never an "unknown key", whatever
    # its value (an impossible one here), so the table cannot drift from the models.
    from training.config import build_config
    from training.rl.algorithm_config import AlgorithmConfig
    from training.rl_config import RLRunConfig
    from training.trl_names import TRL_TABLES

    problems, checked = [], 0
    for table, entries in TRL_TABLES.items():
        classes = [c for c in (SFTRunConfig, RLRunConfig) if table in c.trl_tables]
        assert classes, f"no run config uses TRL table {table}"
        for entry in entries:
            for key in entry.ours:
                for cls in classes:
                    checked += 1
                    if key.startswith("algorithm.overrides."):
                        name = key.removeprefix("algorithm.overrides.")
                        if cls is not RLRunConfig or name not in AlgorithmConfig.model_fields:
                            problems.append(f"{table}.{entry.trl}: {key} ({cls.__name__})")
                        continue
                    data = apply_overrides({}, [f"{key}=\x00impossible"])
                    try:
                        build_config(cls, data)
                    except ConfigError as err:
                        if "unknown key" in str(err):
                            problems.append(f"{table}.{entry.trl}: {key} ({cls.__name__}): {err}")
    assert not problems, "\n".join(problems)
    assert checked > 60
