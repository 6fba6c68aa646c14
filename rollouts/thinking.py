"""Thinking mode (Qwen3-style `<think>...</think>` reasoning before the answer).

- `thinking_template_kwargs(tokenizer, enable_thinking)`: the chat-template variables that turn
  thinking on or off (`{"enable_thinking": ...}`), for templates that read that variable; a
  template that does not read it is an error rather than a silently ignored setting.
- `parse_thinking(text)`: splits a response into its reasoning and its answer (pure).
- `answer_only(reward_fn)`: the reward seeing only the answer part, so that e.g. `last_integer`
  does not pick a number out of the reasoning.

Departure from the seeds: the split is on the text of the closing tag, not on Qwen3's token id
151668, so it works for any tokenizer that writes `</think>` (the tags are parameters).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from plumbing.errors import ConfigError
from rollouts.reward_calls import RewardFn, RewardValue, is_async_reward, reward_name
from rollouts.types import Sample


class Thinking(NamedTuple):
    thinking: str  # the reasoning, without its tags ("" when there is none)
    answer: str  # what follows the last closing tag ("" while the reasoning is unfinished)


def parse_thinking(text: str, *, open_tag: str = "<think>", close_tag: str = "</think>"
                   ) -> Thinking:  # fmt: skip
    """(reasoning, answer) of a response, both stripped.

    The answer is what follows the last `close_tag`. Without a closing tag, a response that
    opens one is all reasoning (cut off before its answer, e.g. truncated), and any other
    response is all answer (thinking was off, or the template wrote the tags in the prompt).
    """
    end = text.rfind(close_tag)
    if end < 0:
        start = text.find(open_tag)
        if start < 0:
            return Thinking("", text.strip())
        return Thinking(text[start + len(open_tag) :].strip(), "")
    head = text[:end]
    start = head.find(open_tag)
    reasoning = head[start + len(open_tag) :] if start >= 0 else head
    return Thinking(reasoning.strip(), text[end + len(close_tag) :].strip())


def answer_only(reward_fn: RewardFn, *, open_tag: str = "<think>", close_tag: str = "</think>"
                ) -> RewardFn:  # fmt: skip
    """`reward_fn` scoring the answer part of each response (`parse_thinking`), not the reasoning.

    The sample it sees has `response_text` = the answer and the reasoning in
    `metadata["thinking"]`; tokens, masks and everything else are the sample's own. Async-ness
    and the reward's name are kept.
    """

    def answer_sample(sample: Sample) -> Sample:
        thinking, answer = parse_thinking(sample.response_text, open_tag=open_tag,
                                          close_tag=close_tag)  # fmt: skip
        metadata = {**sample.metadata, "thinking": thinking}
        return dataclasses.replace(sample, response_text=answer, metadata=metadata)

    if is_async_reward(reward_fn):

        async def on_answer_async(sample: Sample) -> RewardValue:
            return await reward_fn(answer_sample(sample))  # type: ignore[misc]

        on_answer_async.__name__ = reward_name(reward_fn)
        return on_answer_async

    def on_answer(sample: Sample) -> Any:
        return reward_fn(answer_sample(sample))

    on_answer.__name__ = reward_name(reward_fn)
    return on_answer


def thinking_template_kwargs(tokenizer: Any, enable_thinking: bool | None) -> dict[str, Any]:
    """Chat-template variables for `enable_thinking` (None: the template's default, {}).

    Raises:
        ConfigError: `enable_thinking` is set but the tokenizer's chat template never reads
            `enable_thinking` (the setting would change nothing).
    """
    if enable_thinking is None:
        return {}
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # several named templates
        template = " ".join(str(t) for t in dict(template).values())
    if "enable_thinking" not in template:
        raise ConfigError(
            f"model.enable_thinking={enable_thinking}, but the chat template of "
            f"{getattr(tokenizer, 'name_or_path', 'this tokenizer')} does not read "
            "enable_thinking (it has no thinking mode); leave model.enable_thinking null"
        )
    return {"enable_thinking": enable_thinking}
