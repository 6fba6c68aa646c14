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
