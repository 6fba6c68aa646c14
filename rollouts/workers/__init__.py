"""Rollout worker processes: generation and scoring outside the trainer's process (docs/scale.md).

`frames`: the pipe's codec (a JSON header and flat int32/float32 buffers, never pickle);
`worker`: the process (`python -m rollouts.workers.worker`); `manager`: `WorkerRolloutManager`,
the trainer's side, with `AsyncRolloutManager`'s interface.
"""
