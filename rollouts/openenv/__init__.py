"""OpenEnv environments (`env.kind: openenv`; docs/environments.md): episodes in an OpenEnv MCP
tool environment served over HTTP/WebSocket, as rollouts' multi-turn `Env` and `GenerateFn`.

Layers: `config` (the `env.openenv` section) and `wire` (OpenEnv's wire protocol from trio:
sessions, health, tasks) < `episode` (the Env, the GenerateFn, task records) and `server`
(serve an app on 127.0.0.1 for a run). Nothing here imports the `openenv` package: only the
env server needs it (`pip install rollouts[openenv]`). `import rollouts` does not import this.
"""

from rollouts.openenv.config import OpenEnvConfig as OpenEnvConfig
from rollouts.openenv.episode import OpenEnvEpisode as OpenEnvEpisode
from rollouts.openenv.episode import openenv_generate as openenv_generate
from rollouts.openenv.episode import task_records as task_records
from rollouts.openenv.server import serve_env_app as serve_env_app
from rollouts.openenv.wire import OpenEnvError as OpenEnvError
from rollouts.openenv.wire import OpenEnvSession as OpenEnvSession
from rollouts.openenv.wire import check_server as check_server
from rollouts.openenv.wire import fetch_tasks as fetch_tasks
from rollouts.openenv.wire import open_session as open_session
