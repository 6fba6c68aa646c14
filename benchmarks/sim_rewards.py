"""The benchmarks' stand-in reward, in a module of its own: a rollout worker process imports it
by name (`sim_rewards:parity_reward`) without importing the benchmark script (and torch)."""

from __future__ import annotations

from rollouts.types import Sample


def parity_reward(sample: Sample) -> float:
    """A reward that costs nothing and differs inside a group (the sim's variants differ)."""
    return float(sample.response_ids[0] % 2) if sample.response_ids else 0.0
