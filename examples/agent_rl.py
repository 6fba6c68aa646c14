"""GRPO on an agent written with the `openai` client alone: a calculator agent, trained through
the agent proxy (docs/agents.md).

    python examples/agent_rl.py [--model DIR] [--output-dir DIR] [--max-steps N] [key=value ...]

`calculator_agent` knows nothing of this library: it gets an `openai.AsyncOpenAI` and a task
(`messages`, `metadata`), runs the calculator on the model's tool calls until the model
answers, and returns its reward. The rollout side gives each session its own base URL and
turns the calls into exact token trajectories. Without --model it starts from the tool SFT
checkpoint of configs/tool_sft_tiny.yaml (made first if missing), as examples/run_tool_rl.py.
"""

import ast
import json
import operator
import re
import sys

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}  # fmt: skip


def calculate(expression: str) -> str:
    """+ - * / on numbers by walking the syntax tree (model text is never `eval`ed)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        result = value(ast.parse(str(expression)[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"Error: {exc}"
    return str(int(result)) if float(result).is_integer() else repr(result)


async def calculator_agent(client, task) -> float:
    """Ask, run the calculator on each tool call, ask again; 1.0 for the right final integer."""
    messages = list(task["messages"])
    for _ in range(3):  # the model learned its tool in SFT, so no `tools=` schema is sent
        reply = await client.chat.completions.create(model="policy", messages=messages)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            numbers = re.findall(r"-?\d+", message.content or "")
            return float(bool(numbers) and numbers[-1] == str(task["metadata"]["answer"]))
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(expression)})  # fmt: skip
    return 0.0


if __name__ == "__main__":  # the trainer is imported here: calculator_agent_cli.py needs none
    from training.recipes.cli import rl_main
    from training.recipes.rl import RLExtensions

    sys.exit(rl_main(description=__doc__.splitlines()[0], default_config="configs/agent_tiny.yaml",
                     extensions=RLExtensions(agent=calculator_agent)))  # fmt: skip
