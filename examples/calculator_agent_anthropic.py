"""The calculator agent written with the `anthropic` client alone: a program trained through the
agent proxy's Messages dialect (docs/agents.md), as examples/calculator_agent_cli.py is with the
`openai` client. It reads ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY like any Anthropic program, the
task as JSON on stdin, and prints its reward as its last line.

    python examples/run_tool_rl.py --config configs/agent_tiny.yaml \\
        'agent.command=[".venv/bin/python", "examples/calculator_agent_anthropic.py"]'

`--stream` reads each answer from `client.messages.stream(...)`; `--tools` sends the
calculator's input_schema (the tool SFT checkpoint learned the tool without one).
"""

import argparse
import json
import re
import sys

import anthropic
from agent_rl import calculate  # this script's folder is on sys.path

args = argparse.ArgumentParser()
args.add_argument("--stream", action="store_true")
args.add_argument("--tools", action="store_true")
flags = args.parse_args()
TOOLS = [{"name": "calculator", "description": "Evaluate an arithmetic expression.",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}]  # fmt: skip

task = json.load(sys.stdin)
client = anthropic.Anthropic(max_retries=0)
messages = [m for m in task["messages"] if m["role"] != "system"]
system = "\n".join(m["content"] for m in task["messages"] if m["role"] == "system")
request = {"model": "policy", "max_tokens": 256, "messages": messages}
if flags.tools:
    request["tools"] = TOOLS
if system:
    request["system"] = system
reward = 0.0
for _ in range(3):
    if flags.stream:
        with client.messages.stream(**request) as stream:
            reply = stream.get_final_message()
    else:
        reply = client.messages.create(**request)
    messages.append({"role": "assistant", "content": reply.content})
    calls = [block for block in reply.content if block.type == "tool_use"]
    if not calls:
        text = "".join(block.text for block in reply.content if block.type == "text")
        numbers = re.findall(r"-?\d+", text)
        reward = float(bool(numbers) and numbers[-1] == str(task["metadata"]["answer"]))
        break
    results = []
    for call in calls:
        output = calculate(call.input.get("expression", ""))
        results.append({"type": "tool_result", "tool_use_id": call.id, "content": output,
                        "is_error": output.startswith("Error")})  # fmt: skip
    messages.append({"role": "user", "content": results})
print(reward)
