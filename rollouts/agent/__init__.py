"""Train agents written for the OpenAI or Anthropic APIs: a proxy turning calls into exact tokens.

Layers: `openai_shapes`, `anthropic_dialect` and `responses_dialect` (each API's request checks
and answer shapes, pure), `trajectory` (branches of exact token ids, pure) and `turns` (one
sampled turn, whatever the dialect) are used by `proxy` (the per-session HTTP server on
127.0.0.1); `harness` runs an agent program against a session (a Python callable given an
`openai.AsyncOpenAI`, or any subprocess); `generate` puts them together as a `GenerateFn`
for the rollout manager (`agent_generate`). See docs/agents.md.
"""

from rollouts.agent.generate import AgentConfig as AgentConfig
from rollouts.agent.generate import agent_generate as agent_generate
from rollouts.agent.generate import agent_task as agent_task
from rollouts.agent.generate import session_sample as session_sample
from rollouts.agent.generate import session_samples as session_samples
from rollouts.agent.generate import trained_session_samples as trained_session_samples
from rollouts.agent.harness import AgentEndpoint as AgentEndpoint
from rollouts.agent.harness import Harness as Harness
from rollouts.agent.harness import HarnessError as HarnessError
from rollouts.agent.harness import python_harness as python_harness
from rollouts.agent.harness import run_harness as run_harness
from rollouts.agent.harness import subprocess_harness as subprocess_harness
from rollouts.agent.openai_shapes import AgentRequestError as AgentRequestError
from rollouts.agent.proxy import AgentProxy as AgentProxy
from rollouts.agent.proxy import AgentSession as AgentSession
from rollouts.agent.proxy import SessionLimits as SessionLimits
from rollouts.agent.proxy import open_agent_proxy as open_agent_proxy
