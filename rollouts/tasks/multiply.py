"""Synthetic tool-use task: multiplication the tiny model cannot do in its head, with a calculator.

A problem is "What is 4821*397?"; the intended trajectory is one calculator call with the
expression copied from the question, then the tool's result copied into the final answer:

    user       4821*397
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "4821*397"}}</tool_call>
    tool       1913937
    assistant  1913937

The skill RL sharpens is exact copying (question → call, tool output → answer), which SFT on
these traces teaches only approximately. Reward: the last integer of the final assistant turn
equals the product (`rollouts.tasks.arithmetic.correctness_reward` applies unchanged).

Everything here is pure and seeded: the same arguments always give the same files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from rollouts.tasks.arithmetic import write_jsonl

CALCULATOR_SPEC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


@dataclass(frozen=True)
class MultiplyProblem:
    a: int
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a}*{self.b}"

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.expression}]

    def trace(self) -> list[dict]:
        """The ideal tool-use conversation (OpenAI chat format with `tool_calls`)."""
        call = {"name": "calculator", "arguments": {"expression": self.expression}}
        return [
            *self.messages(),
            {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
            {"role": "tool", "content": self.answer},
            {"role": "assistant", "content": self.answer},
        ]

    def direct(self) -> list[dict]:
        """The conversation without the tool: the product answered "in the head"."""
        return [*self.messages(), {"role": "assistant", "content": self.answer}]

    def sft_record(self, tool_specs: bool = False, *, use_tool: bool = True) -> dict:
        messages = self.trace() if use_tool else self.direct()
        return {"messages": messages, **({"tools": [CALCULATOR_SPEC]} if tool_specs else {})}

    def rl_record(self, tool_specs: bool = False) -> dict:
        tools = {"tools": [CALCULATOR_SPEC]} if tool_specs else {}
        return {"messages": self.messages(), **tools, "answer": self.answer}


def make_problems(n: int, *, seed: int, min_digits: int = 3, max_digits: int = 4,
                  exclude: frozenset[tuple[int, int]] = frozenset()
                  ) -> list[MultiplyProblem]:  # fmt: skip
    """`n` distinct problems whose operands have `min_digits`..`max_digits` digits."""
    space = sum(9 * 10 ** (d - 1) for d in range(min_digits, max_digits + 1)) ** 2
    if n + len(exclude) > space // 2:
        raise ValueError(f"{n} problems of {min_digits}-{max_digits} digits: space too small")
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[MultiplyProblem] = []
    while len(out) < n:
        a, b = (rng.randint(10 ** (d - 1), 10**d - 1)
                for d in (rng.randint(min_digits, max_digits) for _ in range(2)))  # fmt: skip
        if (a, b) not in seen:
            seen.add((a, b))
            out.append(MultiplyProblem(a, b))
    return out


@dataclass(frozen=True)
class MultiplyFiles:
    sft_train: Path
    sft_eval: Path
    rl_train: Path
    rl_eval: Path


def write_multiply_datasets(out_dir: str | Path, *, n_sft: int = 4000, n_rl: int = 4000,
                            n_eval: int = 200, seed: int = 0, min_digits: int = 3,
                            max_digits: int = 4, tool_specs: bool = False,
                            direct_fraction: float = 0.0) -> MultiplyFiles:  # fmt: skip
    """SFT tool-use traces and RL prompts, with a held-out split disjoint from both.

    `direct_fraction` of the SFT conversations answer without the tool (with the right
    product, which a small model cannot learn to compute): after SFT the model sometimes calls
    the calculator and sometimes guesses, and RL has a real choice to learn from.

    With `tool_specs` the records carry the calculator's JSON schema (`tools`), which the chat
    template renders as a system turn, as a real model needs. The tiny model learns the tool
    from the traces alone, and leaving the ~150-token schema out makes its sequences 4x shorter.
    """
    out = Path(out_dir)
    kw = dict(min_digits=min_digits, max_digits=max_digits)
    held = make_problems(n_eval, seed=seed, **kw)
    train = make_problems(n_sft + n_rl, seed=seed + 1,
                          exclude=frozenset((p.a, p.b) for p in held), **kw)  # fmt: skip
    sft, rl = train[:n_sft], train[n_sft:]
    rng = random.Random(seed + 2)
    sft_records = [p.sft_record(tool_specs, use_tool=rng.random() >= direct_fraction) for p in sft]
    return MultiplyFiles(
        sft_train=write_jsonl(out / "sft_train.jsonl", sft_records),
        sft_eval=write_jsonl(out / "sft_eval.jsonl", [p.sft_record(tool_specs) for p in held]),
        rl_train=write_jsonl(out / "rl_train.jsonl", [p.rl_record(tool_specs) for p in rl]),
        rl_eval=write_jsonl(out / "rl_eval.jsonl", [p.rl_record(tool_specs) for p in held]),
    )
