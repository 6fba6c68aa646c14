"""Thinking mode: `model.enable_thinking` reaches the chat template in SFT and RL (tested with a
Qwen3-style thinking template on the tiny tokenizer), `parse_thinking` splits reasoning from the
answer, and `answer_only` lets a reward read just the answer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rollouts.chat_turns import ChatTurns
from rollouts.errors import ConfigError
from rollouts.rewards import exact_match_reward
from rollouts.scoring import score_sample
from rollouts.thinking import answer_only, parse_thinking, thinking_template_kwargs
from rollouts.types import Sample
from training.config import SFTRunConfig
from training.recipes.rl import load_prompts
from training.recipes.sft import prepare_sft_data
from training.rl_config import RLRunConfig

# Qwen3's convention, reduced to ChatML: an assistant turn always carries a think block (empty
# without reasoning); with thinking off, the generation prompt writes the empty block itself.
THINKING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n'"
    " + m.content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)


@pytest.fixture
def thinking_model_dir(tiny_model_dir, tmp_path):
    """The tiny model's tokenizer with a thinking chat template, saved as a model directory."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(tmp_path / "thinking")
    return tmp_path / "thinking"


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\n7+8 is 15\n</think>\n\n15", ("7+8 is 15", "15")),
        ("15", ("", "15")),  # thinking off: all answer
        ("<think>still going", ("still going", "")),  # cut off while thinking: no answer
        ("reasoning</think>15", ("reasoning", "15")),  # the template opened the block
        ("<think>a</think>draft</think> 15", ("a</think>draft", "15")),  # the last close counts
    ],
)
def test_parse_thinking_splits_reasoning_from_the_answer(text, expected):
    assert tuple(parse_thinking(text)) == expected


async def test_answer_only_rewards_the_answer_not_a_number_in_the_reasoning():
    sample = Sample((1,), (2, 3), (1, 1), response_text="<think>is it 12?</think>",
                    metadata={"answer": "12"})  # fmt: skip
    exact = exact_match_reward()
    assert (await score_sample(exact, sample, timeout_s=5)).reward == 1.0  # read the reasoning
    scored = await score_sample(answer_only(exact), sample, timeout_s=5)
    assert scored.reward == 0.0 and scored.status == "completed"
    answered = Sample(
        (1,), (2,), (1,), response_text="<think>7+5</think> 12", metadata={"answer": "12"}
    )
    assert (await score_sample(answer_only(exact), answered, timeout_s=5)).reward == 1.0


def test_enable_thinking_for_a_template_without_it_is_a_config_error(tiny_tokenizer):
    assert thinking_template_kwargs(tiny_tokenizer, None) == {}
    with pytest.raises(ConfigError, match="does not read enable_thinking"):
        thinking_template_kwargs(tiny_tokenizer, False)


@pytest.mark.parametrize(("enable", "prompt_end"), [(False, "assistant\n<think>\n\n</think>\n\n"),
                                                    (True, "assistant\n")])  # fmt: skip
def test_rl_prompts_follow_enable_thinking(thinking_model_dir, tmp_path, enable, prompt_end):
    tok = AutoTokenizer.from_pretrained(thinking_model_dir)
    train = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "2+2"}],
                                                "answer": "4"}])  # fmt: skip
    config = RLRunConfig.model_validate({"model": {"path": str(thinking_model_dir),
                                                   "enable_thinking": enable},
                                         "data": {"train_path": train}})  # fmt: skip
    (prompt,), _ = load_prompts(config, tok)
    assert tok.decode(prompt.prompt_ids).endswith("<|im_start|>user\n2+2<|im_end|>\n"
                                                  "<|im_start|>" + prompt_end)  # fmt: skip


@pytest.mark.parametrize(("enable", "trained_start"), [(False, "4"), (True, "<think>")])
def test_sft_trains_the_empty_think_block_only_with_thinking_on(thinking_model_dir, tmp_path,
                                                               enable, trained_start):  # fmt: skip
    tok = AutoTokenizer.from_pretrained(thinking_model_dir)
    row = {"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}
    config = SFTRunConfig.model_validate({
        "model": {"path": str(thinking_model_dir), "enable_thinking": enable},
        "data": {"train_path": write_jsonl(tmp_path / "sft.jsonl", [row] * 2)},
    })  # fmt: skip
    prepared = prepare_sft_data(config, tok)
    (sample,) = prepared.data.train.get_prompts(1)
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert tok.decode(trained).startswith(trained_start)


@pytest.mark.parametrize(("kwargs", "header"), [({"enable_thinking": False}, "<think>\n\n</think>\n\n"),
                                                ({}, "")])  # fmt: skip
def test_multi_turn_episodes_render_each_next_turn_with_the_thinking_setting(
    thinking_model_dir, kwargs, header
):
    tok = AutoTokenizer.from_pretrained(thinking_model_dir)
    chat = ChatTurns.from_tokenizer(tok, kwargs)
    sampled = tok.encode('<tool_call name="calculator">2+2</tool_call><|im_end|>')
    appended = chat.appended_ids(sampled, [{"role": "tool", "content": "4"}])
    assert tok.decode(appended).endswith("<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
                                         + header)  # fmt: skip
