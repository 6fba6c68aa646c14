"""The Kubernetes manifests of `rollouts launch --k8s`: the Slurm script's layout as objects.

- `NAME-engine`: a headless Service and a StatefulSet of `inference.nodes` pods, each running
  the node's servers (ports `port`..`port + servers_per_node - 1`); a server that exits is
  started again by the pod's loop, and the trainer's pool re-syncs it before it serves. Their
  URLs are stable DNS names: `http://NAME-engine-K.NAME-engine.NAMESPACE.svc:PORT`.
- `NAME-trainer`: a headless Service and a StatefulSet of `trainer.nodes` pods (started in
  parallel), each `torchrun --nnodes N --rdzv-endpoint NAME-trainer-0.NAME-trainer:PORT` with
  every engine URL as `--engine-url` (and the gateway's as `--router-url`); `--resume`, so a
  pod that restarts continues from the latest checkpoint in `run_dir` (a shared volume:
  `kubernetes.run_dir_claim`).
- With `inference.gateway`: `NAME-gateway`, the smg gateway (`sglang_router.launch_router`
  over every engine URL) as a one-replica StatefulSet with a headless Service of its own.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

import yaml

from training.launch.slurm import engine_command
from training.launch.spec import ClusterSpec


def engine_urls(spec: ClusterSpec) -> list[str]:
    k8s, name = spec.kubernetes, f"{spec.name}-engine"
    return [f"http://{name}-{k}.{name}.{k8s.namespace}.svc:{spec.inference.port + i}"
            for k in range(spec.inference.nodes) for i in range(spec.servers_per_node)]  # fmt: skip


def _service(spec: ClusterSpec, role: str, ports: Sequence[int]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": f"{spec.name}-{role}",
            "namespace": spec.kubernetes.namespace,
            "labels": _labels(spec, role),
        },
        "spec": {
            "clusterIP": "None",  # headless: one DNS name per pod
            "selector": _labels(spec, role),
            "ports": [{"name": f"p{p}", "port": p, "targetPort": p} for p in ports],
        },
    }


def _labels(spec: ClusterSpec, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "rollouts", "app.kubernetes.io/instance": spec.name,
            "rollouts/role": role}  # fmt: skip


def _container(spec: ClusterSpec, role: str, script: str, ports: Sequence[int], gpus: int,
               probe_port: int | None, probe_path: str = "/health_generate") -> dict[str, Any]:  # fmt: skip
    env = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    env.append({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    container: dict[str, Any] = {
        "name": role,
        "image": spec.kubernetes.image,
        "command": ["bash", "-c", script],
        "env": env,
        "ports": [{"containerPort": p, "name": f"p{p}"} for p in ports],
    }
    if spec.workdir:
        container["workingDir"] = spec.workdir
    if gpus:
        container["resources"] = {"limits": {spec.kubernetes.gpu_resource: gpus}}
    if spec.kubernetes.run_dir_claim:
        container["volumeMounts"] = [{"name": "run-dir", "mountPath": spec.run_dir}]
    if probe_port is not None:
        container["readinessProbe"] = {
            "httpGet": {"path": probe_path, "port": probe_port},
            "periodSeconds": 10,
            "failureThreshold": 3,
        }
    return container


def _stateful_set(spec: ClusterSpec, role: str, replicas: int,
                  container: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    pod: dict[str, Any] = {"containers": [container], "restartPolicy": "Always"}
    if spec.kubernetes.run_dir_claim:
        pod["volumes"] = [{"name": "run-dir",
                           "persistentVolumeClaim": {"claimName": spec.kubernetes.run_dir_claim}}]  # fmt: skip
    if spec.kubernetes.service_account:
        pod["serviceAccountName"] = spec.kubernetes.service_account
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": f"{spec.name}-{role}",
            "namespace": spec.kubernetes.namespace,
            "labels": _labels(spec, role),
        },
        "spec": {
            "serviceName": f"{spec.name}-{role}",
            "replicas": replicas,
            "podManagementPolicy": "Parallel",  # all pods at once: torchrun waits for them
            "selector": {"matchLabels": _labels(spec, role)},
            "template": {"metadata": {"labels": _labels(spec, role)}, "spec": pod},
        },
    }


def render_manifests(spec: ClusterSpec, *, rl_config: str, model: str,
                     overrides: Sequence[str] = (),
                     config_args: Sequence[str] = ()) -> list[dict[str, Any]]:  # fmt: skip
    """Services and StatefulSets (in apply order) for `spec` running the RL config `rl_config`."""
    inf = spec.inference
    ports = [inf.port + i for i in range(spec.servers_per_node)]
    server = " ".join(w if w.startswith("$") else shlex.quote(w)
                      for w in engine_command(spec, model, config_args))  # fmt: skip
    engine_script = (
        f'for ((i = 0; i < {spec.servers_per_node}; i++)); do\n'
        f'  port=$(({inf.port} + i))\n'
        f'  (for try in $(seq 0 {inf.max_restarts}); do {shlex.quote(spec.python)} {server}; '
        'echo "server on $port exited with $?" >&2; sleep 5; done) &\n'
        'done\nwait\n'
    )  # fmt: skip
    gpus = inf.gpus_per_node
    objects = [
        _service(spec, "engine", ports),
        _stateful_set(
            spec,
            "engine",
            inf.nodes,
            _container(spec, "engine", engine_script, ports, gpus, ports[0]),
        ),
    ]
    router: list[str] = []
    if inf.gateway:
        gw = f"{spec.name}-gateway"
        script = " ".join([shlex.quote(spec.python), "-m", "sglang_router.launch_router",
                           "--worker-urls", *engine_urls(spec), "--host", "0.0.0.0",
                           "--port", str(inf.gateway_port)])  # fmt: skip
        objects += [_service(spec, "gateway", [inf.gateway_port]),
                    _stateful_set(spec, "gateway", 1, _container(
                        spec, "gateway", script, [inf.gateway_port], 0, inf.gateway_port,
                        "/health"))]  # fmt: skip
        router = ["--router-url", f"http://{gw}-0.{gw}.{spec.kubernetes.namespace}.svc:"
                  f"{inf.gateway_port}"]  # fmt: skip
    rdzv = f"{spec.name}-trainer-0.{spec.name}-trainer.{spec.kubernetes.namespace}.svc"
    trainer = [spec.python, "-m", "torch.distributed.run", f"--nnodes={spec.trainer.nodes}",
               f"--nproc-per-node={spec.nproc_per_node}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={rdzv}:{spec.trainer.rdzv_port}",
               f"--rdzv-id={spec.name}", spec.trainer.entry, "--config", rl_config,
               "--output-dir", spec.run_dir, "--resume", "--model", model,
               *(a for url in engine_urls(spec) for a in ("--engine-url", url)), *router,
               *overrides]  # fmt: skip
    # Wait (bounded) for the engines before the run starts: it checks each one at start.
    wait = (
        f"deadline=$((SECONDS + {int(inf.startup_timeout_s)}))\n"
        f"for url in {' '.join(engine_urls(spec))}; do\n"
        '  until curl -sf -o /dev/null --max-time 5 "$url/health_generate"; do\n'
        '    if ((SECONDS > deadline)); then echo "error: engine $url not healthy after '
        f'{int(inf.startup_timeout_s)} s (inference.startup_timeout_s)" >&2; exit 1; fi\n'
        "    sleep 5\n  done\ndone\n"
    )
    objects += [
        _service(spec, "trainer", [spec.trainer.rdzv_port]),
        _stateful_set(
            spec,
            "trainer",
            spec.trainer.nodes,
            _container(
                spec,
                "trainer",
                wait + "exec " + shlex.join(trainer) + "\n",
                [spec.trainer.rdzv_port],
                spec.trainer.gpus_per_node,
                None,
            ),
        ),
    ]
    return objects


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the containers' bash scripts) as literal blocks, readable as written."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_manifests(objects: Sequence[dict[str, Any]]) -> str:
    """The manifests as one multi-document YAML file (`kubectl apply -f`)."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=100)
