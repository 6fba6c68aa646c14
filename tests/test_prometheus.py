"""The trainer's Prometheus endpoint: scraped during a real tiny RL run, every metric that
docs/prometheus.md lists is served with its type, and those it says move do."""

from __future__ import annotations

import itertools
import math
import re
import socket
from pathlib import Path

import httpx
import trio

from training.loops.prometheus import PrometheusExporter

DOCS = Path(__file__).resolve().parent.parent / "docs" / "prometheus.md"
SAMPLE = re.compile(r'^([a-z_]+)(\{(?:[a-z_]+="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def documented() -> dict[str, tuple[str, bool]]:
    """metric -> (type, moves) from the docs' table."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("| `rollouts_") and len(cells) == 5:
            rows[cells[0].strip("`")] = (cells[1], cells[4] == "yes")
    return rows


def parse(text: str) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Samples (metric -> labels -> value) and types of an exposition, checking its grammar:
    each metric's HELP and TYPE come before its samples."""
    values: dict[str, dict[str, float]] = {}
    types: dict[str, str] = {}
    helped: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name in helped and kind in ("gauge", "counter")
            types[name] = kind
        elif line:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.group(1), match.group(2) or "", match.group(3)
            assert name in types, f"{name} has no # TYPE before its samples"
            values.setdefault(name, {})[labels] = float(value)
    return values, types


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spread_reward(sample) -> float:
    return (sum(sample.response_ids) % 3) / 2


async def test_every_documented_metric_is_served_and_moves_during_a_real_run(tiny_model_dir,
                                                                              tmp_path):  # fmt: skip
    from engines.local import open_local_engine
    from rollouts.shaping import add_shaping, length_bonus
    from training.recipes.rl import RLExtensions, run_rl_recipe
    from training.rl_config import RLRunConfig

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}", "answer": "{2 * i}"}}\n' for i in range(8)))
    port = free_port()
    scrapes: dict[int, str] = {}  # by the step they report: one per step seen
    done = trio.Event()

    async def scrape() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            while not done.is_set():
                try:
                    answer = await client.get(f"http://127.0.0.1:{port}/metrics")
                except httpx.TransportError:  # not listening yet
                    await trio.sleep(0.02)
                    continue
                assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
                step = re.search(r"^rollouts_step (\S+)$", answer.text, re.M)
                if step:
                    scrapes.setdefault(int(float(step.group(1))), answer.text)
                await trio.sleep(0.02)

    async with open_local_engine(tiny_model_dir, num_threads=1) as server:
        config = RLRunConfig.model_validate({
            "output_dir": str(tmp_path / "run"), "sft_config": None,
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_path": str(data), "task": None},
            "engines": {"urls": [server.url]},
            "rollout": {"batch_size": 2, "n_samples_per_prompt": 3, "filter_groups": "none",
                        "mode": "overlap", "sampling": {"max_new_tokens": 6}},
            "train": {"max_steps": 5, "checkpoint_every": 10, "eval_samples": 0,
                      "prometheus": {"port": port}},
            "backend": {"num_threads": 1},
        })  # fmt: skip
        extensions = RLExtensions(reward_fn=spread_reward,
                                  transforms=(add_shaping("length", length_bonus(0.01)),))  # fmt: skip
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scrape)
            await run_rl_recipe(config, extensions=extensions)
            done.set()
    with trio.fail_after(5):  # the endpoint closed with the run
        try:
            await trio.open_tcp_stream("127.0.0.1", port)
            raise AssertionError("the Prometheus endpoint still listens after the run")
        except OSError:
            pass

    table = documented()
    assert len(table) >= 25
    steps = sorted(scrapes)
    assert len(steps) >= 3, f"scraped steps {steps}"  # the last may end with the run
    parsed = [parse(scrapes[s]) for s in steps]
    for values, types in parsed:
        assert set(values) == set(table), "served and documented metrics differ"
        for name, (kind, _) in table.items():
            assert types[name] == kind, name
    for name, (kind, moves) in table.items():
        if kind == "counter":  # never decrease
            for (a, _), (b, _) in itertools.pairwise(parsed):
                assert all(b[name][k] >= a[name][k] for k in a[name]), name
        if moves:  # more than one value over the run's scrapes
            seen = {tuple(sorted(values[name].items())) for values, _ in parsed}
            assert len(seen) > 1, f"{name} did not move: {parsed[0][0][name]}"
    for step, (values, _) in zip(steps, parsed, strict=True):  # a fresh run: one per step
        assert values["rollouts_steps_total"][""] == values["rollouts_step"][""] == step
    assert all(v["rollouts_engine_healthy"] == {'{engine="0"}': 1.0} for v, _ in parsed)


def test_exposition_escapes_labels_and_writes_non_finite_values():
    exporter = PrometheusExporter()
    exporter(3, {'reward/a"b\\c\nd': float("nan"), "loss": float("inf"), "reward_mean": 0.5})
    text = exporter.render()
    assert 'rollouts_reward_component{name="a\\"b\\\\c\\nd"} NaN' in text.splitlines()
    values, types = parse(text)
    assert values["rollouts_loss"] == {"": math.inf} and values["rollouts_step"] == {"": 3.0}
    assert values["rollouts_steps_total"] == {"": 1.0}
    assert types["rollouts_steps_total"] == "counter"
