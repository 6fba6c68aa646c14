"""The cluster description `rollouts launch` reads: a small YAML of where engines and trainer run.

```yaml
name: rl-qwen                 # the job's (and the Kubernetes objects') name
run_dir: /shared/runs/rl-qwen # on a filesystem every node shares: output_dir, logs, weights
workdir: /shared/rollouts     # the project checkout the nodes run from (default: here)
python: /shared/venv/bin/python
inference:
  nodes: 1
  engine: sglang              # or local (`python -m engines.local`, CPU clusters)
  gpus_per_node: 8
  tp: 2                       # SGLang --tp-size per server
  dp: 1                       # SGLang --dp-size per server: gpus_per_node / (tp x dp) servers
  gateway: false              # the smg gateway in front of them (trainer gets --router-url)
trainer: {nodes: 2, gpus_per_node: 8}
slurm: {partition: gpu, account: myproj, time: "04:00:00"}
kubernetes: {namespace: rl, image: ghcr.io/me/rollouts:latest, run_dir_claim: shared-runs}
```

Loaded like a run config (training/config.py): unknown keys and bad values are refused naming
`file:line` and the key; so are GPU counts a server's TP x DP does not divide.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from plumbing.errors import ConfigError
from rollouts.config import Strict
from training.config import load_config
from training.config_hints import locate

_NAME = r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$"  # a DNS-1123 label short enough for pod names


class InferenceNodes(Strict):
    nodes: int = Field(1, ge=1, description="nodes that run only engines (started first)")
    engine: Literal["sglang", "local"] = Field(
        "sglang", description="sglang: `python -m sglang.launch_server`; local: engines.local"
    )
    gpus_per_node: int = Field(0, ge=0, description="0: CPU (engine: local only)")
    tp: int = Field(1, ge=1, description="SGLang --tp-size of each server")
    dp: int = Field(1, ge=1, description="SGLang --dp-size of each server")
    servers_per_node: int | None = Field(
        None, ge=1, description="local engines per CPU node (default 1); GPUs: derived"
    )
    port: int = Field(30000, ge=1024, le=65000, description="first server's port on a node")
    model: str | None = Field(
        None, description="what the engines serve; default: the RL config's model.path"
    )
    threads: int = Field(1, ge=1, description="local engine: torch threads per server")
    extra_args: list[str] = Field([], description="more server flags, passed as they are")
    gateway: bool = Field(False, description="smg gateway (sglang_router) before the servers")
    gateway_port: int = Field(30080, ge=1024, le=65535)
    startup_timeout_s: float = Field(900.0, gt=0, description="the wait for every /health")
    max_restarts: int = Field(3, ge=0, description="times a server that exits is started again")


class TrainerNodes(Strict):
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0, description="torchrun --nproc-per-node (0: CPU)")
    procs_per_node: int = Field(1, ge=1, description="with gpus_per_node 0: CPU ranks per node")
    rdzv_port: int = Field(29500, ge=1024, le=65535)
    entry: str = Field("examples/run_rl.py", description="the script torchrun runs (workdir)")


class SlurmSettings(Strict):
    partition: str | None = None
    account: str | None = None
    time: str | None = Field(None, description="--time, e.g. 04:00:00")
    qos: str | None = None
    max_attempts: int = Field(
        3, ge=1, description="a trainer that fails (node lost) is requeued until this many runs"
    )
    container_image: str | None = Field(
        None, description="pyxis: srun --container-image (with --container-mounts=run_dir)"
    )
    sbatch_args: list[str] = Field([], description="more #SBATCH lines, e.g. [--exclusive]")
    share_nodes: bool = Field(
        False,
        description="engines and trainer on the same nodes (a one-node cluster, or GPUs split "
        "between them); default: inference nodes first, then trainer nodes",
    )


class KubernetesSettings(Strict):
    namespace: str = Field("default", pattern=_NAME)
    image: str = Field("rollouts:latest", min_length=1)
    gpu_resource: str = Field("nvidia.com/gpu", min_length=1)
    run_dir_claim: str | None = Field(
        None, description="PersistentVolumeClaim (ReadWriteMany) mounted at run_dir on every pod"
    )
    service_account: str | None = None


class ClusterSpec(Strict):
    name: str = Field("rollouts", pattern=_NAME, description="job name, Kubernetes name prefix")
    run_dir: str = Field(min_length=1, description="shared directory: the run's output_dir")
    workdir: str | None = Field(None, description="the rollouts checkout on the nodes")
    python: str = Field("python", description="the interpreter (a venv's bin/python)")
    env: dict[str, str] = Field({}, description="environment of every step / container")
    inference: InferenceNodes = InferenceNodes()
    trainer: TrainerNodes = TrainerNodes()
    slurm: SlurmSettings = SlurmSettings()
    kubernetes: KubernetesSettings = KubernetesSettings()

    @property
    def servers_per_node(self) -> int:
        inf = self.inference
        if inf.gpus_per_node == 0:
            return inf.servers_per_node or 1
        if inf.engine == "local":
            return inf.gpus_per_node  # one CUDA local engine per GPU
        return inf.gpus_per_node // (inf.tp * inf.dp)

    @property
    def gpus_per_server(self) -> int:
        inf = self.inference
        if inf.gpus_per_node == 0:
            return 0
        return 1 if inf.engine == "local" else inf.tp * inf.dp

    @property
    def total_nodes(self) -> int:
        if self.slurm.share_nodes:
            return max(self.inference.nodes, self.trainer.nodes)
        return self.inference.nodes + self.trainer.nodes

    @property
    def nproc_per_node(self) -> int:
        return self.trainer.gpus_per_node or self.trainer.procs_per_node


def load_cluster(path: str | os.PathLike[str]) -> ClusterSpec:
    """The validated cluster description at `path`.

    Raises:
        ConfigError: missing file, bad YAML, unknown key, bad value, or GPUs and TP/DP that do
            not fit; each names `file:line` and the key.
    """
    p = Path(path)
    spec = load_config(ClusterSpec, p)
    inf = spec.inference

    def refuse(key: str, message: str) -> ConfigError:
        where = locate(key, p, ()) or str(p)
        return ConfigError(f"invalid cluster description:\n  {where}: {key}: {message}")

    if inf.engine == "sglang":
        if inf.gpus_per_node == 0:
            raise refuse("inference.gpus_per_node", "SGLang servers need GPUs: give "
                         "gpus_per_node, or engine: local for CPU nodes")  # fmt: skip
        if inf.gpus_per_node % (inf.tp * inf.dp):
            key = "inference.dp" if inf.dp > 1 else "inference.tp"
            raise refuse(key, f"tp x dp = {inf.tp} x {inf.dp} does not divide gpus_per_node = "
                         f"{inf.gpus_per_node}: each server takes tp x dp GPUs of its node; give "
                         "a tp (and dp) whose product divides it")  # fmt: skip
        if inf.servers_per_node is not None:
            raise refuse("inference.servers_per_node", "with SGLang the servers per node are "
                         "gpus_per_node / (tp x dp): remove servers_per_node")  # fmt: skip
    elif inf.tp > 1 or inf.dp > 1:
        raise refuse("inference.tp" if inf.tp > 1 else "inference.dp",
                     "the local engine has no tensor or data parallelism: use tp: 1, dp: 1, and "
                     "servers_per_node (CPU) or one server per GPU")  # fmt: skip
    if inf.gateway and inf.engine == "local":
        raise refuse("inference.gateway", "the smg gateway fronts SGLang servers: set it false "
                     "with engine: local (the trainer balances over the engines itself)")  # fmt: skip
    if not Path(spec.run_dir).is_absolute():
        raise refuse("run_dir", f"{spec.run_dir!r} is relative: give the absolute path every "
                     "node sees the shared directory at")  # fmt: skip
    return spec
