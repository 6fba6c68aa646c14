"""Token ids of the pieces a multi-turn rollout appends, cut out of the tokenizer's chat template.

A multi-turn trajectory is extended, never re-tokenized: the engine's sampled ids go in as
they are, and between model turns only the *appended segment* is tokenized on its own — the
rest of the assistant turn's closing text the model did not sample (e.g. the "\\n" after
`<|im_end|>`, or all of `<|im_end|>\\n` when the model stopped on a stop string), the
environment's messages (tool results, user follow-ups), and the next assistant header.

The segment is the difference between the template's rendering of the conversation so far
and of the conversation with the new messages. A template that renders the history
differently once more messages follow (Qwen3's drops the reasoning of assistant turns before
the last user turn, and the empty think block of a turn that is no longer last) cannot be
extended there: `appended_ids` says so (None), and the caller starts a *branch*, a new sample
whose prompt is the re-rendered history, instead of producing silently wrong tokens. Pure:
tokenizer only, no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plumbing.errors import ConfigError

_MARK = "\u2063turn-mark\u2063"  # invisible separator: never produced by a real conversation
_BASE = ({"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK})


def chat_turns_per_tokenizer(who: str, template_kwargs: Mapping[str, Any] | None = None
                             ) -> Callable[[Any], ChatTurns]:  # fmt: skip
    """A function giving the `ChatTurns` of a tokenizer, read from its template once per
    tokenizer (a generate function sees the tokenizer it was given, or its context's).

    Raises (from the returned function):
        ConfigError: no tokenizer (None), naming `who` and how to give one.
    """
    chats: dict[int, ChatTurns] = {}

    def chat_for(tok: Any) -> ChatTurns:
        if tok is None:
            raise ConfigError(f"{who} needs the tokenizer: pass tokenizer=... or give the "
                              "rollout manager one")  # fmt: skip
        if id(tok) not in chats:
            chats[id(tok)] = ChatTurns.from_tokenizer(tok, template_kwargs)
        return chats[id(tok)]

    return chat_for


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Any,
            generation_prompt: bool, template_kwargs: Mapping[str, Any]) -> str:  # fmt: skip
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=tools,
        add_generation_prompt=generation_prompt,
        tokenize=False,
        **template_kwargs,
    )


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


@dataclass(frozen=True)
class ChatTurns:
    """The chat template's turn structure for one tokenizer (build with `from_tokenizer`).

    Attributes:
        tokenizer: a HF tokenizer with a chat template.
        turn_close_ids: ids of the text the template writes after an assistant message's
            content (ChatML: `<|im_end|>\\n`). The model usually samples a prefix of it (the
            end-of-turn token); the rest is appended as non-sampled tokens.
    """

    tokenizer: Any
    turn_close_ids: tuple[int, ...]
    template_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None
                       ) -> ChatTurns:  # fmt: skip
        """Read the turn close from the template (`template_kwargs`: extra template variables,
        e.g. `{"enable_thinking": False}`, used for every rendering).

        Raises:
            ConfigError: the template does not render assistant content verbatim.
        """
        kwargs = dict(template_kwargs or {})
        text = _render(tokenizer, _BASE, None, False, kwargs)
        at = text.rfind(_MARK)
        if at < 0:
            raise ConfigError(
                "the chat template does not render assistant message content verbatim; "
                "multi-turn rollouts cannot find where an assistant turn ends"
            )
        return cls(tokenizer, tuple(_encode(tokenizer, text[at + len(_MARK) :])), kwargs)

    def sampled_close(self, output_ids: Sequence[int]) -> int:
        """How many leading tokens of the turn close `output_ids` ends with (0 if none)."""
        close = self.turn_close_ids
        for k in range(min(len(close), len(output_ids)), 0, -1):
            if tuple(output_ids[-k:]) == close[:k]:
                return k
        return 0

    def decode_turn(self, output_ids: Sequence[int]) -> str:
        """The text of a model turn without its sampled end-of-turn tokens.

        Special tokens are kept (`skip_special_tokens=False`): tool-call tags may be special
        tokens, and a parser must see them.
        """
        k = self.sampled_close(output_ids)
        content = list(output_ids[: len(output_ids) - k])
        return self.tokenizer.decode(content, skip_special_tokens=False)

    def appended_ids(self, output_ids: Sequence[int], messages: Sequence[Mapping[str, Any]],
                     tools: Any = None, history: Sequence[Mapping[str, Any]] | None = None
                     ) -> list[int] | None:  # fmt: skip
        """Ids to append after a model turn that produced `output_ids`, or None.

        That is: the part of the turn close the model did not sample, then `messages` as the
        template renders them after the conversation, then the next assistant header.

        Args:
            history: the conversation so far, ending with the assistant turn that produced
                `output_ids` (default: a stand-in user/assistant pair, which tells only
                whether the template is extendable whatever the conversation).

        Returns:
            None when the template renders `history` differently once `messages` follow: the
            next turn cannot extend these tokens and must start a branch from the rendering
            of `[*history, *messages]`.
        """
        base = _BASE if history is None else [dict(m) for m in history]
        before = _render(self.tokenizer, base, tools, False, self.template_kwargs)
        after = _render(self.tokenizer, [*base, *messages], tools, True, self.template_kwargs)
        if not after.startswith(before):
            return None
        rest_of_close = self.turn_close_ids[self.sampled_close(output_ids) :]
        return [*rest_of_close, *_encode(self.tokenizer, after[len(before) :])]
