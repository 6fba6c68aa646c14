"""Rewards the rollout-worker tests name by `module:function` (a worker imports them itself):
light on purpose, so a worker process starts without torch."""


def index_reward(sample) -> float:
    """0, 1, ... within each group: every group has a reward spread, whatever was sampled."""
    return float(sample.index_in_group)


def raising_reward(sample) -> float:
    raise ValueError("this reward always fails")


def answer_reward(sample) -> float:
    """The prompt's answer / 10: groups differ, so a batch-mean baseline leaves a gradient even
    when greedy sampling makes a group's samples equal."""
    return float(sample.metadata["answer"]) / 10


def loud_index_reward(sample) -> float:
    """`index_reward` that also prints: a worker's stdout carries frames, so this must reach
    stderr and leave the frames intact."""
    print(f"scoring sample {sample.index_in_group}")
    return float(sample.index_in_group)


def slow_reward(sample) -> float:
    """Longer than the tests' worker_timeout_s: the worker gives no answer in time."""
    import time

    time.sleep(20)
    return 0.0
