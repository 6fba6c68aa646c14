"""A new user's first week with their own data (issue 42's trial), reproducible.

Writes, into DIR: `chats.jsonl` (300 chat lines: multi-turn, tool calls, prompt/completion, 5
lines over the tiny model's 1,024-token context), `held_out.jsonl` (40, one over the context),
`train_prompts.jsonl` / `eval_prompts.jsonl` (180 / 20 RL prompts: reverse two words) and
`myreward.py` (a partial-credit reward in the working directory, no PYTHONPATH). Then, from DIR:

    python examples/make_tiny_model.py --output tiny
    rollouts sft --model tiny --data chats.jsonl --eval-data held_out.jsonl --epochs 2 \\
        --output-dir runs/mysft
    rollouts generate --model runs/mysft --data held_out.jsonl --limit 8 --max-new-tokens 24
    rollouts rl --config configs/rl_tiny.yaml --model runs/mysft --max-steps 10 \\
        --output-dir runs/myrl data.train_path=train_prompts.jsonl \\
        data.eval_path=eval_prompts.jsonl reward.fn=myreward:reverse_reward \\
        engines.n_local=2 train.eval_every=5     # kill -9 one engine mid-run

    python benchmarks/first_week.py DIR
"""

import argparse
import json
import random
from pathlib import Path

WORDS = ("apple river stone cloud maple tiger lemon orbit piano candle forest silver rocket "
         "garden").split()  # fmt: skip
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert units.",
    "parameters": {"type": "object", "properties": {
        "value": {"type": "number"}, "unit_from": {"type": "string"},
        "unit_to": {"type": "string"}}, "required": ["value", "unit_from", "unit_to"]}}}  # fmt: skip


def chat(i: int, rng: random.Random) -> dict:
    """A plain two-turn chat, a tool call with its result, or a prompt/completion line."""
    if i % 3 == 0:
        w = rng.choice(WORDS)
        return {"messages": [{"role": "system", "content": "You reverse words."},
                             {"role": "user", "content": f"Reverse {w}"},
                             {"role": "assistant", "content": w[::-1]},
                             {"role": "user", "content": f"And {w.upper()}?"},
                             {"role": "assistant", "content": w.upper()[::-1]}]}  # fmt: skip
    if i % 3 == 1:
        km, call = rng.randint(1, 500), f"c{i}"
        args = json.dumps({"value": km, "unit_from": "km", "unit_to": "mi"})
        return {"tools": [CONVERT], "messages": [
            {"role": "user", "content": f"How many miles is {km} km?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call, "type": "function",
                 "function": {"name": "convert", "arguments": args}}]},
            {"role": "tool", "tool_call_id": call, "name": "convert",
             "content": f"{km * 0.621371:.2f}"},
            {"role": "assistant", "content": f"{km} km is {km * 0.621371:.2f} miles."}]}  # fmt: skip
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return {"prompt": f"{a}+{b}=", "completion": str(a + b)}


def over_context(rng: random.Random) -> dict:
    words = " ".join(rng.choice(WORDS) for _ in range(900))  # ~3,900 tokens
    return {"messages": [{"role": "system", "content": words},
                         {"role": "user", "content": "Summarise."},
                         {"role": "assistant", "content": "Words."}]}  # fmt: skip


REWARD = '''"""Partial credit: the share of positions where the response matches the reversed word."""


def reverse_reward(sample):
    want, got = sample.metadata["answer"], sample.response_text.strip()
    return sum(a == b for a, b in zip(want, got)) / max(len(want), 1)
'''


def write(out: Path, seed: int = 7) -> None:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    lines = [chat(i, rng) for i in range(300)]
    for j in (17, 101, 202, 250, 299):
        lines[j] = over_context(rng)
    held = [chat(1000 + i, rng) for i in range(40)]
    held[5] = lines[17]
    words = (rng.choice(WORDS) + rng.choice(WORDS) for _ in range(200))
    prompts = [{"messages": [{"role": "user", "content": f"Reverse {w}"}], "answer": w[::-1]}
               for w in words]  # fmt: skip
    for name, rows in (("chats", lines), ("held_out", held), ("train_prompts", prompts[:180]),
                       ("eval_prompts", prompts[180:])):  # fmt: skip
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "myreward.py").write_text(REWARD)
    print(f"wrote {out}: chats.jsonl held_out.jsonl train_prompts.jsonl eval_prompts.jsonl "
          "myreward.py")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    write(parser.parse_args().dir)
