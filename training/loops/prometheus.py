"""A Prometheus text endpoint on the RL trainer (`train.prometheus: {port: N}`; off by default).

`PrometheusExporter` is a logger (`(step, metrics) -> None`, training/loops/loggers.py): after
each step it keeps that step's values as gauges and adds to its counters; `render()` writes them
in the Prometheus text exposition format (version 0.0.4: `# HELP`, `# TYPE`, one sample per
line). `open_prometheus(settings)` serves `GET /metrics` on `host:port` (127.0.0.1 by default)
from a task in a nursery of its own, for as long as its `async with` block runs. No dependency:
the format and the HTTP answer are a few lines each.

What is covered: the metrics of docs/prometheus.md's table, as of the last step logged. What
is not: values between steps (a scrape during step k reads step k-1's), histograms, and other
paths than /metrics (404).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from plumbing.nursery import open_nursery

log = logging.getLogger("rollouts.prometheus")

# name: (type, help, the step metric it reads); counters add the step's value, gauges keep it.
# fmt: off
SERIES: dict[str, tuple[str, str, str]] = {
    "rollouts_step": ("gauge", "Last RL step logged.", "step"),
    "rollouts_weight_version": ("gauge", "Weight version the trainer has pushed.", "weight_version"),
    "rollouts_reward_mean": ("gauge", "Mean reward of the step's samples.", "reward_mean"),
    "rollouts_reward_std": ("gauge", "Std of the step's rewards.", "reward_std"),
    "rollouts_truncation_rate": ("gauge", "Fraction of samples cut at the length limit.", "truncation_rate"),
    "rollouts_rollout_tokens_per_second": ("gauge", "Generation throughput of the step.", "rollout_tokens_per_s"),
    "rollouts_step_seconds": ("gauge", "Wall time of the step.", "time_step_s"),
    "rollouts_generate_seconds": ("gauge", "Time the step waited for its batch.", "time_generate_s"),
    "rollouts_train_seconds": ("gauge", "Time the step spent training.", "time_train_s"),
    "rollouts_staleness_mean": ("gauge", "Mean weight versions the samples lag the trainer.", "staleness_mean"),
    "rollouts_staleness_max": ("gauge", "Largest lag of a sample, in weight versions.", "staleness_max"),
    "rollouts_logprob_mismatch_mean_abs": ("gauge", "Mean |engine - trainer logprob| per token.", "logprob_diff_mean_abs"),
    "rollouts_logprob_mismatch_max_abs": ("gauge", "Largest |engine - trainer logprob|.", "logprob_diff_max_abs"),
    "rollouts_loss": ("gauge", "Training loss of the step.", "loss"),
    "rollouts_grad_norm": ("gauge", "Gradient norm before clipping.", "grad_norm"),
    "rollouts_held_groups": ("gauge", "Groups waiting in the data buffer to be served first.", "held_groups"),
    "rollouts_steps_total": ("counter", "Steps this process trained.", ""),
    "rollouts_samples_total": ("counter", "Samples trained on.", "n_samples"),
    "rollouts_trained_tokens_total": ("counter", "Tokens the loss saw.", "n_trained_tokens"),
    "rollouts_samples_failed_total": ("counter", "Samples that failed (engine, tool, reward).", "samples_failed"),
    "rollouts_groups_filtered_total": ("counter", "Groups dropped by the group filter.", "groups_filtered"),
}
# per engine i, from the step metrics engine<i>/<key>: name -> (type, help, key)
ENGINE_SERIES: dict[str, tuple[str, str, str]] = {
    "rollouts_engine_healthy": ("gauge", "1 while the engine answers, else 0.", "healthy"),
    "rollouts_engine_requests_total": ("counter", "Samples sent to the engine.", "samples_sent"),
    "rollouts_engine_failures_total": ("counter", "Requests to the engine that failed.", "failed"),
    "rollouts_engine_in_flight": ("gauge", "Samples sent and not yet answered (its queue).", ""),
}
# fmt: on
COMPONENT = "rollouts_reward_component"
LAST_STEP_TIME = "rollouts_last_step_timestamp_seconds"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _format(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class PrometheusExporter:
    """The step metrics as Prometheus series (see the module docstring)."""

    def __init__(self) -> None:
        self.address: tuple[str, int] | None = None  # where it serves, once `serve` is bound
        self._values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}

    def _set(self, name: str, value: float, labels: tuple[tuple[str, str], ...] = ()) -> None:
        self._values.setdefault(name, {})[labels] = value

    def _add(self, name: str, value: float, labels: tuple[tuple[str, str], ...] = ()) -> None:
        series = self._values.setdefault(name, {})
        series[labels] = series.get(labels, 0.0) + value

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {**metrics, "step": step}
        for name, (kind, _, key) in SERIES.items():
            value = 1.0 if not key else _number(values.get(key))
            if value is not None:
                (self._add if kind == "counter" else self._set)(name, value)
        for key, value in metrics.items():
            number = _number(value)
            if number is None:
                continue
            if key.startswith("reward/"):
                self._set(COMPONENT, number, (("name", key.removeprefix("reward/")),))
            engine, _, field = key.partition("/")
            if engine.startswith("engine") and engine[6:].isdigit():
                labels = (("engine", engine[6:]),)
                for name, (_, _, source) in ENGINE_SERIES.items():
                    if source == field:  # engine counters are cumulative already: kept
                        self._set(name, number, labels)
                sent, received = (
                    metrics.get(f"{engine}/samples_sent"),
                    metrics.get(f"{engine}/samples_received"),
                )
                if field == "samples_sent" and _number(received) is not None:
                    self._set("rollouts_engine_in_flight", float(sent) - float(received), labels)
        self._set(LAST_STEP_TIME, time.time())

    def render(self) -> str:
        """The text exposition of every series set so far."""
        helps = {**{k: v[:2] for k, v in SERIES.items()}, **{k: v[:2] for k, v in ENGINE_SERIES.items()},
                 COMPONENT: ("gauge", "Mean of a named reward component over the step."),
                 LAST_STEP_TIME: ("gauge", "Unix time the last step was logged.")}  # fmt: skip
        lines = []
        for name, series in self._values.items():
            kind, text = helps[name]
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            for labels, value in series.items():
                tag = ",".join(f'{k}="{_label(v)}"' for k, v in labels)
                lines.append(
                    f"{name}{{{tag}}} {_format(value)}" if tag else f"{name} {_format(value)}"
                )
        return "\n".join(lines) + "\n"

    async def _answer(self, stream: trio.abc.Stream) -> None:
        """One HTTP/1.0-style exchange: read the request head (5 s at most), answer, close."""
        head = b""
        with trio.move_on_after(5):  # a client that sends nothing is dropped
            while b"\r\n\r\n" not in head and len(head) < 8192:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                head += chunk
        parts = head.split(b"\r\n", 1)[0].split()
        ok = len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics"
        body = (self.render() if ok else "not found: GET /metrics\n").encode()
        status = b"200 OK" if ok else b"404 Not Found"
        await stream.send_all(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; "
                              b"version=0.0.4; charset=utf-8\r\nContent-Length: "
                              + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)  # fmt: skip
        await stream.aclose()

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve GET /metrics until cancelled; `task_status.started((host, port))` once bound."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[:2]
        log.info("Prometheus metrics at http://%s:%d/metrics", *bound)
        task_status.started(bound)
        await trio.serve_listeners(self._answer, listeners)


@asynccontextmanager
async def open_prometheus(settings: Any) -> AsyncIterator[PrometheusExporter | None]:
    """The exporter serving on `settings.host:settings.port` inside the block (None: off).

    Args:
        settings: a `PrometheusConfig` (`train.prometheus`), or None.

    Raises:
        OSError: the port is taken (the message names it); pick another `train.prometheus.port`.
    """
    if settings is None:
        yield None
        return
    exporter = PrometheusExporter()
    async with open_nursery() as nursery:
        try:
            exporter.address = await nursery.start(exporter.serve, settings.host, settings.port)
        except OSError as err:
            raise OSError(err.errno, f"train.prometheus: cannot listen on {settings.host}:"
                          f"{settings.port} ({err.strerror}); choose a free port") from err  # fmt: skip
        yield exporter
        nursery.cancel_scope.cancel()
