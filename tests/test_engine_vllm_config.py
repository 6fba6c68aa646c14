"""`engines.kind: vllm` and the SGLang → vLLM translation, without a vLLM server (those tests
are in tests/vllm/, `make test-vllm`): what vLLM cannot do is refused before a run starts,
naming the cause; SGLang sampling params map onto vLLM's or are refused by name."""

from __future__ import annotations

import pytest

from engines.vllm_params import completion_body, parse_completion
from rollouts.errors import ConfigError
from training.config import load_config
from training.rl_config import RLRunConfig

URL = "engines.urls=[http://127.0.0.1:8000]"


def test_kind_defaults_to_sglang_and_vllm_by_url_loads():
    assert RLRunConfig().engines.kind == "sglang"
    assert load_config(RLRunConfig, None, ["engines.kind=vllm", URL]).engines.kind == "vllm"


@pytest.mark.parametrize(
    ("overrides", "cause"),
    [
        ([], "engines.urls is empty: vLLM servers are not launched"),
        ([URL, "engines.pause_mode=retract"], "engines.pause_mode=retract"),
        ([URL, "model.lora.rank=8"], "model.lora: LoRA adapters are not hot-loaded"),
        ([URL, "engines.router_url=http://127.0.0.1:9"], "engines.router_url"),
    ],
)
def test_what_vllm_cannot_do_is_refused_by_the_config_naming_the_cause(overrides, cause):
    with pytest.raises(ConfigError, match="engines.kind=vllm cannot run with") as err:
        load_config(RLRunConfig, None, ["engines.kind=vllm", *overrides])
    assert cause in str(err.value)


def test_sglang_sampling_params_become_vllm_completion_fields():
    body = completion_body("m", [1, 2], {"max_new_tokens": 5, "min_new_tokens": 1, "top_k": 3,
                                         "sampling_seed": 7, "stop_token_ids": [9], "n": 1},
                           rid="r1", logprobs=2, cache_salt="ns")  # fmt: skip
    assert body["max_tokens"] == 5 and body["min_tokens"] == 1 and body["seed"] == 7
    assert body["top_k"] == 3 and body["stop_token_ids"] == [9] and body["request_id"] == "r1"
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    assert body["return_token_ids"] and body["include_stop_str_in_output"]
    assert body["cache_salt"] == "ns" and "n" not in body
    with pytest.raises(ValueError, match="sampling param 'json_schema' has no vLLM"):
        completion_body("m", [1], {"json_schema": "{}"}, rid=None, logprobs=None, cache_salt="")
    with pytest.raises(ValueError, match="use generate_batch"):
        completion_body("m", [1], {"n": 2}, rid=None, logprobs=None, cache_salt="")


def test_a_vllm_answer_becomes_a_generate_result_with_top_k_by_token_id():
    # an answer of vLLM 0.32's /v1/completions (logprobs=1, return_tokens_as_token_ids)
    answer = {"id": "cmpl-r1", "usage": {"prompt_tokens": 2, "completion_tokens": 2},
              "choices": [{"text": "ab", "finish_reason": "stop", "stop_reason": None,
                           "token_ids": [7, 2],
                           "logprobs": {"token_logprobs": [-0.5, -1.5],
                                        "top_logprobs": [{"token_id:7": -0.5},
                                                         {"token_id:4": -0.2,
                                                          "token_id:2": -1.5}]}}]}  # fmt: skip
    result = parse_completion(answer, rid="", prompt_len=2, latency_s=0.1, weight_version="3",
                              with_logprobs=True, top_logprobs_num=1)  # fmt: skip
    assert result.rid == "cmpl-r1" and result.output_ids == (7, 2)
    assert result.output_logprobs == (-0.5, -1.5) and result.weight_version == "3"
    assert result.finish_reason.type == "stop" and result.finish_reason.matched == 2  # EOS
    assert result.output_top_logprobs == (((-0.5, 7),), ((-0.2, 4),))  # the sampled 2 is not top-1
