"""A structural check of the manifests `rollouts launch` writes (no `kubernetes` package needed).

It checks the fields the launcher uses against the Kubernetes API's rules for them: apiVersion
and kind of Service (v1) and StatefulSet (apps/v1); metadata.name a DNS-1123 label (a
subdomain for StatefulSets); a Service's ports and selector, headless (`clusterIP: None`)
where a StatefulSet names it as serviceName; a StatefulSet's replicas, selector that matches
its template's labels, containers (name, image, command a list of strings, ports, env entries
with exactly one of value / valueFrom, resources, probes), and volume mounts that name a
volume of the pod. `validate_manifests` returns every problem as `doc N (Kind/name): path:
what`, empty when there are none.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_KINDS = {"Service": "v1", "StatefulSet": "apps/v1"}


class _Check:
    def __init__(self, where: str) -> None:
        self.where, self.problems = where, []

    def fail(self, path: str, what: str) -> None:
        self.problems.append(f"{self.where}: {path}: {what}")

    def typed(self, obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...],
              path: str, required: bool = True) -> Any:  # fmt: skip
        if key not in obj:
            if required:
                self.fail(f"{path}.{key}", "required field missing")
            return None
        value = obj[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(f"{path}.{key}", f"expected {getattr(kind, '__name__', kind)}, got "
                      f"{type(value).__name__} {value!r}")  # fmt: skip
            return None
        return value

    def port(self, value: Any, path: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
            self.fail(path, f"a port is an integer in 1..65535, got {value!r}")

    def name(self, value: Any, path: str, limit: int = 63) -> None:
        if not isinstance(value, str) or len(value) > limit or not _LABEL.match(value):
            self.fail(path, f"not a DNS-1123 label of at most {limit} characters: {value!r}")


def _container(c: _Check, item: Any, path: str, volumes: set[str]) -> None:
    if not isinstance(item, dict):
        return c.fail(path, "a container is a mapping")
    c.name(item.get("name"), f"{path}.name")
    c.typed(item, "image", str, path)
    command = c.typed(item, "command", list, path, required=False)
    if command is not None and not all(isinstance(w, str) for w in command):
        c.fail(f"{path}.command", "every word must be a string")
    for i, port in enumerate(c.typed(item, "ports", list, path, required=False) or []):
        c.port(port.get("containerPort") if isinstance(port, dict) else port,
               f"{path}.ports[{i}].containerPort")  # fmt: skip
    for i, env in enumerate(c.typed(item, "env", list, path, required=False) or []):
        where = f"{path}.env[{i}]"
        if not isinstance(env, dict) or not isinstance(env.get("name"), str):
            c.fail(where, "an env entry needs a string name")
        elif ("value" in env) == ("valueFrom" in env):
            c.fail(where, "give exactly one of value and valueFrom")
        elif "value" in env and not isinstance(env["value"], str):
            c.fail(f"{where}.value", f"env values are strings, got {env['value']!r}")
    limits = (c.typed(item, "resources", dict, path, required=False) or {}).get("limits", {})
    for key, value in limits.items():
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            c.fail(f"{path}.resources.limits.{key}", f"a quantity, got {value!r}")
    for i, mount in enumerate(c.typed(item, "volumeMounts", list, path, required=False) or []):
        if not isinstance(mount, dict) or mount.get("name") not in volumes:
            c.fail(f"{path}.volumeMounts[{i}]", f"names no volume of the pod ({sorted(volumes)})")
        elif not str(mount.get("mountPath", "")).startswith("/"):
            c.fail(f"{path}.volumeMounts[{i}].mountPath", "must be an absolute path")
    probe = c.typed(item, "readinessProbe", dict, path, required=False)
    if probe is not None:
        get = c.typed(probe, "httpGet", dict, f"{path}.readinessProbe")
        if get is not None:
            c.port(get.get("port"), f"{path}.readinessProbe.httpGet.port")
            if not str(get.get("path", "")).startswith("/"):
                c.fail(f"{path}.readinessProbe.httpGet.path", "must start with /")


def _service(c: _Check, spec: Mapping[str, Any]) -> None:
    ports = c.typed(spec, "ports", list, "spec") or []
    if not ports:
        c.fail("spec.ports", "a Service needs at least one port")
    for i, port in enumerate(ports):
        if not isinstance(port, dict):
            c.fail(f"spec.ports[{i}]", "a port is a mapping")
            continue
        c.port(port.get("port"), f"spec.ports[{i}].port")
        if "targetPort" in port:
            c.port(port["targetPort"], f"spec.ports[{i}].targetPort")
    selector = c.typed(spec, "selector", dict, "spec")
    if selector is not None and not all(isinstance(v, str) for v in selector.values()):
        c.fail("spec.selector", "label values are strings")


def _stateful_set(c: _Check, spec: Mapping[str, Any]) -> None:
    c.typed(spec, "serviceName", str, "spec")
    replicas = c.typed(spec, "replicas", int, "spec")
    if replicas is not None and replicas < 0:
        c.fail("spec.replicas", f"must be >= 0, got {replicas}")
    if spec.get("podManagementPolicy", "OrderedReady") not in ("OrderedReady", "Parallel"):
        c.fail("spec.podManagementPolicy", "OrderedReady or Parallel")
    match = (c.typed(spec, "selector", dict, "spec") or {}).get("matchLabels")
    template = c.typed(spec, "template", dict, "spec") or {}
    labels = template.get("metadata", {}).get("labels")
    if not isinstance(match, dict) or not match:
        c.fail("spec.selector.matchLabels", "required, a non-empty mapping")
    elif not isinstance(labels, dict) or any(labels.get(k) != v for k, v in match.items()):
        c.fail("spec.template.metadata.labels", f"must carry the selector's labels {match}")
    pod = c.typed(template, "spec", dict, "spec.template") or {}
    if pod.get("restartPolicy", "Always") != "Always":
        c.fail("spec.template.spec.restartPolicy", "a StatefulSet's pods restart Always")
    volumes = set()
    for i, volume in enumerate(c.typed(pod, "volumes", list, "spec.template.spec", False) or []):
        if not isinstance(volume, dict) or not isinstance(volume.get("name"), str):
            c.fail(f"spec.template.spec.volumes[{i}]", "a volume needs a name")
        else:
            volumes.add(volume["name"])
    containers = c.typed(pod, "containers", list, "spec.template.spec") or []
    if not containers:
        c.fail("spec.template.spec.containers", "a pod needs at least one container")
    for i, item in enumerate(containers):
        _container(c, item, f"spec.template.spec.containers[{i}]", volumes)


def validate_manifests(docs: Iterable[Any]) -> list[str]:
    """Every problem of the manifests `docs` (parsed YAML documents); [] when they pass."""
    problems: list[str] = []
    services: dict[tuple[str, str], Mapping[str, Any]] = {}
    sets = []
    for n, doc in enumerate(docs):
        kind = doc.get("kind") if isinstance(doc, dict) else None
        meta = doc.get("metadata", {}) if isinstance(doc, dict) else {}
        c = _Check(f"doc {n} ({kind}/{meta.get('name') if isinstance(meta, dict) else '?'})")
        if kind not in _KINDS:
            c.fail("kind", f"expected one of {sorted(_KINDS)}, got {kind!r}")
        elif doc.get("apiVersion") != _KINDS[kind]:
            c.fail("apiVersion", f"{kind} is {_KINDS[kind]}, got {doc.get('apiVersion')!r}")
        else:
            c.typed(doc, "metadata", dict, "")
            c.name(meta.get("name"), "metadata.name", 63 if kind == "Service" else 253)
            c.name(meta.get("namespace", "default"), "metadata.namespace")
            spec = c.typed(doc, "spec", dict, "") or {}
            if kind == "Service":
                _service(c, spec)
                services[(meta.get("namespace", "default"), meta.get("name"))] = spec
            else:
                _stateful_set(c, spec)
                sets.append((c, meta.get("namespace", "default"), spec))
        problems += c.problems
    for c, namespace, spec in sets:  # a StatefulSet's serviceName: a headless Service here
        service = services.get((namespace, spec.get("serviceName")))
        if service is None:
            problems.append(f"{c.where}: spec.serviceName: no Service {spec.get('serviceName')!r}"
                            f" in namespace {namespace!r} among these manifests")  # fmt: skip
        elif service.get("clusterIP") != "None":
            problems.append(f"{c.where}: spec.serviceName: Service {spec.get('serviceName')!r} "
                            "must be headless (clusterIP: None) to give each pod a DNS name")  # fmt: skip
        elif service.get("selector") != spec.get("selector", {}).get("matchLabels"):
            problems.append(f"{c.where}: spec.serviceName: Service {spec.get('serviceName')!r} "
                            "selects other pods than this StatefulSet's")  # fmt: skip
    return problems
