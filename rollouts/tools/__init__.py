"""Tool calling: records, parsers, executors (calculator, sandboxed Python), tool rewards.

Layers: `base` (Tool, ParsedToolCall, ToolResult, running a call into a ToolCallRecord) is used
by `parsers` (text -> calls, pure), the executors `calculator` (pure ast walk) and
`python_sandbox` (subprocess under trio), and `rewards` (pure functions of samples). The
multi-turn loop that drives them is `rollouts.multiturn`, over the envs in `rollouts.envs`.
"""

from rollouts.tools.base import ParsedToolCall as ParsedToolCall
from rollouts.tools.base import Tool as Tool
from rollouts.tools.base import ToolError as ToolError
from rollouts.tools.base import ToolExecutor as ToolExecutor
from rollouts.tools.base import ToolParser as ToolParser
from rollouts.tools.base import ToolResult as ToolResult
from rollouts.tools.base import execute_tool_call as execute_tool_call
from rollouts.tools.base import execute_tool_calls as execute_tool_calls
from rollouts.tools.base import tool_message as tool_message
from rollouts.tools.base import tool_specs as tool_specs
from rollouts.tools.base import tools_by_name as tools_by_name
from rollouts.tools.calculator import CalculatorError as CalculatorError
from rollouts.tools.calculator import CalculatorLimits as CalculatorLimits
from rollouts.tools.calculator import calculator_tool as calculator_tool
from rollouts.tools.calculator import evaluate_arithmetic as evaluate_arithmetic
from rollouts.tools.parsers import parse_hermes_tool_calls as parse_hermes_tool_calls
from rollouts.tools.parsers import parse_xml_tool_calls as parse_xml_tool_calls
from rollouts.tools.python_sandbox import SandboxLimits as SandboxLimits
from rollouts.tools.python_sandbox import SandboxResult as SandboxResult
from rollouts.tools.python_sandbox import python_tool as python_tool
from rollouts.tools.python_sandbox import run_python as run_python
from rollouts.tools.rewards import count_model_turns as count_model_turns
from rollouts.tools.rewards import tool_metrics as tool_metrics
from rollouts.tools.rewards import tool_success_reward as tool_success_reward
from rollouts.tools.rewards import tool_usage_reward as tool_usage_reward
