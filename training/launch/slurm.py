"""The Slurm batch script of `rollouts launch`: engines on the first nodes, then torchrun.

The script (docs/cluster.md shows one) resolves the job's hosts with `scontrol show hostnames`,
starts one `srun` step per engine server (each restarts its server when it exits, up to
`inference.max_restarts`: the trainer's pool gives a server that comes back the current weights
before it serves, engines/pool_membership.py), waits for every `/health_generate` (deadline
`inference.startup_timeout_s`), optionally starts the smg gateway, then runs the trainer as one
`srun` over the trainer nodes: `torchrun --nnodes N --rdzv-endpoint FIRST_TRAINER:PORT` with one
`--engine-url` per server and `--resume` (a requeued attempt continues from its checkpoint).
Logs go to `run_dir/logs/job-ID/attempt-K/`. A trainer that fails (exit not 0, 2 or 130: a node
lost, a crash) has the job requeued (`scontrol requeue`) until `slurm.max_attempts` runs.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from string import Template
from typing import TYPE_CHECKING

from engines.lora import LoraLaunch
from training.launch.spec import ClusterSpec

if TYPE_CHECKING:
    from training.rl_config import RLRunConfig


class _Script(Template):
    delimiter = "@@"  # bash owns `$` and `[@]`


_TEMPLATE = _Script("""\
#!/bin/bash
# Written by `rollouts launch` (docs/cluster.md); submit with: sbatch THIS_FILE
#SBATCH --job-name=@@name
#SBATCH --nodes=@@total_nodes
#SBATCH --ntasks-per-node=1
@@sbatch_lines#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=@@run_dir/logs/slurm-%j.out
set -uo pipefail

RUN_DIR=@@run_dir
PYTHON=@@python
cd @@workdir || exit 2
@@exports
ATTEMPT=${SLURM_RESTART_COUNT:-0}
LOG_DIR="$RUN_DIR/logs/job-$SLURM_JOB_ID/attempt-$ATTEMPT"
mkdir -p "$LOG_DIR"
echo "job $SLURM_JOB_ID attempt $ATTEMPT on $SLURM_JOB_NODELIST; logs in $LOG_DIR"

mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
INFERENCE_HOSTS=("${HOSTS[@]:0:@@inference_nodes}")
TRAINER_HOSTS=("${HOSTS[@]:@@trainer_offset:@@trainer_nodes}")
SERVERS_PER_NODE=@@servers_per_node
ENGINE_PORT=@@port
ENGINE_URLS=()
for host in "${INFERENCE_HOSTS[@]}"; do
  for ((i = 0; i < SERVERS_PER_NODE; i++)); do
    ENGINE_URLS+=("http://$host:$((ENGINE_PORT + i))")
  done
done

STEP_PIDS=()
stop_steps() {
  if ((${#STEP_PIDS[@]})); then kill "${STEP_PIDS[@]}" 2>/dev/null; fi
  wait
}
trap stop_steps EXIT

# Engines: one srun step per server. A server that exits is started again (up to
# @@max_restarts times); the trainer gives it the current weights before it serves again.
for host in "${INFERENCE_HOSTS[@]}"; do
  for ((i = 0; i < SERVERS_PER_NODE; i++)); do
    port=$((ENGINE_PORT + i))
    srun --nodes=1 --ntasks=1 --nodelist="$host" --overlap @@container\\
      --output="$LOG_DIR/engine-$host-$port.log" \\
      bash -c 'for try in $(seq 0 @@max_restarts); do "$@"; echo "server exited with $?" >&2; sleep 5; done' engine \\
      @@engine_command &
    STEP_PIDS+=($!)
  done
done

# Every engine answers /health_generate before the trainer starts.
deadline=$((SECONDS + @@startup_timeout_s))
for url in "${ENGINE_URLS[@]}"; do
  until curl -sf -o /dev/null --max-time 5 "$url/health_generate"; do
    if ((SECONDS > deadline)); then
      echo "error: engine $url not healthy after @@startup_timeout_s s (inference.startup_timeout_s); see $LOG_DIR/engine-*.log" >&2
      exit 1
    fi
    sleep 5
  done
done
echo "engines up: ${ENGINE_URLS[*]}"
@@gateway
ENGINE_ARGS=()
for url in "${ENGINE_URLS[@]}"; do ENGINE_ARGS+=(--engine-url "$url"); done

srun --nodes=@@trainer_nodes --ntasks-per-node=1 --nodelist="$(IFS=,; echo "${TRAINER_HOSTS[*]}")" \\
  --overlap --kill-on-bad-exit=1 @@container--output="$LOG_DIR/trainer-%N.log" \\
  "$PYTHON" -m torch.distributed.run --nnodes=@@trainer_nodes --nproc-per-node=@@nproc_per_node \\
  --rdzv-backend=c10d --rdzv-endpoint="${TRAINER_HOSTS[0]}:@@rdzv_port" --rdzv-id="$SLURM_JOB_ID" \\
  @@trainer_command "${ENGINE_ARGS[@]}" "${ROUTER_ARGS[@]}" @@overrides
rc=$?
echo "trainer exited with $rc (attempt $ATTEMPT)"
if ((rc != 0 && rc != 2 && rc != 130 && ATTEMPT + 1 < @@max_attempts)); then
  echo "requeueing job $SLURM_JOB_ID: the next attempt resumes from the latest checkpoint" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit $rc
""")

_GATEWAY = _Script("""
# The smg gateway on the first inference node: generation goes through it, weight syncs to
# each server (--engine-url).
srun --nodes=1 --ntasks=1 --nodelist="${INFERENCE_HOSTS[0]}" --overlap @@container\\
  --output="$LOG_DIR/gateway.log" \\
  "$PYTHON" -m sglang_router.launch_router --worker-urls "${ENGINE_URLS[@]}" \\
  --host 0.0.0.0 --port @@gateway_port &
STEP_PIDS+=($!)
ROUTER_ARGS=(--router-url "http://${INFERENCE_HOSTS[0]}:@@gateway_port")
deadline=$((SECONDS + 120))
until curl -sf -o /dev/null --max-time 5 "${ROUTER_ARGS[1]}/health"; do
  if ((SECONDS > deadline)); then
    echo "error: gateway ${ROUTER_ARGS[1]} not healthy after 120 s; see $LOG_DIR/gateway.log" >&2
    exit 1
  fi
  sleep 2
done
""")


def _q(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


def config_engine_args(config: RLRunConfig, engine: str) -> list[str]:
    """The server flags the RL config implies, as the recipe gives the engines it launches:
    request slots, keys, LoRA serving (`model.lora`), SGLang's memory saver (`colocate`)."""
    ec = config.engines
    args = ["--max-running-requests", str(ec.max_running_requests)]
    if engine == "local":
        args += ["--dtype", ec.local_dtype]
    elif ec.colocate:
        args.append("--enable-memory-saver")  # /release_memory_occupation needs it
    if ec.api_key:
        args += ["--api-key", ec.api_key]
    if ec.admin_api_key:
        args += ["--admin-api-key", ec.admin_api_key]
    lora = config.model.lora
    if lora is not None:  # as training/recipes/rl_engines.py:lora_launch
        args += LoraLaunch(max_lora_rank=lora.rank, target_modules=lora.target_modules,
                           max_loras_per_batch=lora.keep + 1).args()  # fmt: skip
    return args


def engine_command(spec: ClusterSpec, model: str, config_args: Sequence[str] = ()) -> list[str]:
    """The server's argv, with `$port` and `$i` (the server's index on its node) left to bash;
    `config_args`: those of `config_engine_args`."""
    inf = spec.inference
    if inf.engine == "sglang":
        args = ["-m", "sglang.launch_server", "--model-path", model, "--host", "0.0.0.0",
                "--port", "$port", "--tp-size", str(inf.tp), "--dp-size", str(inf.dp),
                "--base-gpu-id", f"$((i * {spec.gpus_per_server}))", "--weight-version", "0"]  # fmt: skip
    else:
        args = ["-m", "engines.local", "--model-path", model, "--host", "0.0.0.0",
                "--port", "$port", "--num-threads", str(inf.threads), "--weight-version", "0"]  # fmt: skip
        if inf.gpus_per_node:
            args += ["--device", "cuda"]
    return [*args, *config_args, *inf.extra_args]


def _engine_line(spec: ClusterSpec, model: str, config_args: Sequence[str]) -> str:
    """The engine argv for the template: `$port` and `$((...))` stay unquoted for bash."""
    words = []
    for word in engine_command(spec, model, config_args):
        words.append(f'"{word}"' if word.startswith("$") else shlex.quote(word))
    return '"$PYTHON" ' + " ".join(words)


def render_sbatch(spec: ClusterSpec, *, rl_config: str, model: str, workdir: str,
                  overrides: Sequence[str] = (), config_args: Sequence[str] = ()) -> str:  # fmt: skip
    """The batch script for `spec` training with the RL config at `rl_config` (absolute);
    `config_args`: the server flags the config implies (`config_engine_args`)."""
    s = spec.slurm
    gpus = max(spec.inference.gpus_per_node, spec.trainer.gpus_per_node)
    sbatch = [f"--gpus-per-node={gpus}"] if gpus else []
    sbatch += [f"--{k}={v}" for k, v in (("partition", s.partition), ("account", s.account),
               ("time", s.time), ("qos", s.qos)) if v]  # fmt: skip
    sbatch += s.sbatch_args
    container = ""
    if s.container_image:
        mounts = f"{spec.run_dir}:{spec.run_dir}"
        container = _q([f"--container-image={s.container_image}",
                        f"--container-mounts={mounts}", f"--container-workdir={workdir}"]) + " "  # fmt: skip
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(spec.env.items()))
    trainer = [spec.trainer.entry, "--config", rl_config, "--output-dir", spec.run_dir,
               "--resume", "--model", model]  # fmt: skip
    gateway = ""
    if spec.inference.gateway:
        gateway = _GATEWAY.substitute(container=container, gateway_port=spec.inference.gateway_port)
    return _TEMPLATE.substitute(
        name=spec.name,
        total_nodes=spec.total_nodes,
        sbatch_lines="".join(f"#SBATCH {line}\n" for line in sbatch),
        run_dir=shlex.quote(spec.run_dir),
        python=shlex.quote(spec.python),
        workdir=shlex.quote(workdir),
        exports=exports,
        inference_nodes=spec.inference.nodes,
        trainer_offset=0 if s.share_nodes else spec.inference.nodes,
        trainer_nodes=spec.trainer.nodes,
        servers_per_node=spec.servers_per_node,
        port=spec.inference.port,
        max_restarts=spec.inference.max_restarts,
        container=container,
        engine_command=_engine_line(spec, model, config_args),
        startup_timeout_s=int(spec.inference.startup_timeout_s),
        gateway=gateway or "ROUTER_ARGS=()\n",
        nproc_per_node=spec.nproc_per_node,
        rdzv_port=spec.trainer.rdzv_port,
        trainer_command=_q(trainer),
        overrides=_q(overrides),
        max_attempts=s.max_attempts,
    )
