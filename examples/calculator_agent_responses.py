"""The calculator agent written with the `openai` client's Responses API: a program trained
through the agent proxy's Responses dialect (docs/agents.md), as
examples/calculator_agent_cli.py is with chat completions. It reads OPENAI_BASE_URL /
OPENAI_API_KEY, the task as JSON on stdin, and prints its reward as its last line. Each call
after the first sends only the tool outputs, with `previous_response_id`.

    python examples/run_tool_rl.py --config configs/agent_tiny.yaml \\
        'agent.command=[".venv/bin/python", "examples/calculator_agent_responses.py"]'

`--stream` reads each answer from the streamed events; `--tools` sends the calculator's
parameters (the tool SFT checkpoint learned the tool without them).
"""

import argparse
import json
import re
import sys

from agent_rl import calculate  # this script's folder is on sys.path
from openai import OpenAI

args = argparse.ArgumentParser()
args.add_argument("--stream", action="store_true")
args.add_argument("--tools", action="store_true")
flags = args.parse_args()
TOOLS = [{"type": "function", "name": "calculator",
          "description": "Evaluate an arithmetic expression.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}]  # fmt: skip


def respond(**request):
    if not flags.stream:
        return client.responses.create(**request)
    for event in client.responses.create(stream=True, **request):
        if event.type in ("response.completed", "response.incomplete"):
            return event.response
    raise RuntimeError("the stream ended without a response")


task = json.load(sys.stdin)
client = OpenAI(max_retries=0)
request = {"model": "policy", "input": task["messages"]}
if flags.tools:
    request["tools"] = TOOLS
reward = 0.0
for _ in range(3):
    reply = respond(**request)
    calls = [item for item in reply.output if item.type == "function_call"]
    if not calls:
        numbers = re.findall(r"-?\d+", reply.output_text)
        reward = float(bool(numbers) and numbers[-1] == str(task["metadata"]["answer"]))
        break
    outputs = [{"type": "function_call_output", "call_id": call.call_id,
                "output": calculate(json.loads(call.arguments).get("expression", ""))}
               for call in calls]  # fmt: skip
    request = {**request, "previous_response_id": reply.id, "input": outputs}
print(reward)
