"""The calculator agent of examples/agent_rl.py as a standalone program: a subprocess harness.

Trained with `agent.command` (docs/agents.md): it reads OPENAI_BASE_URL / OPENAI_API_KEY like
any OpenAI program, the task as JSON on stdin, and prints its reward as its last line.

    python examples/run_tool_rl.py --config configs/agent_tiny.yaml \\
        'agent.command=[".venv/bin/python", "examples/calculator_agent_cli.py"]'

`--crash-rate P` / `--hang-rate P` make a share of the sessions exit 1 or hang, to watch
them fail their samples (counted in `samples_failed`) while the run goes on.
"""

import argparse
import json
import random
import re
import sys
import time

from agent_rl import calculate  # this script's folder is on sys.path
from openai import OpenAI

args = argparse.ArgumentParser()
args.add_argument("--crash-rate", type=float, default=0.0)
args.add_argument("--hang-rate", type=float, default=0.0)
flags = args.parse_args()
luck = random.random()
if luck < flags.crash_rate:
    sys.exit("crashed on purpose")
if luck < flags.crash_rate + flags.hang_rate:
    time.sleep(3600)

task = json.load(sys.stdin)
client = OpenAI(max_retries=0)
messages, reward = list(task["messages"]), 0.0
for _ in range(3):
    message = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        numbers = re.findall(r"-?\d+", message.content or "")
        reward = float(bool(numbers) and numbers[-1] == str(task["metadata"]["answer"]))
        break
    for call in message.tool_calls:
        expression = json.loads(call.function.arguments).get("expression", "")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
print(reward)
