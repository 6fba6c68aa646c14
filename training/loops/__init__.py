"""The loops: `run_sft_training` and `run_rl_training`, pure async functions over the stateful
components, plus their loggers and held-out evaluation.

Layer: above `training.rl` and `training.backend`; the recipes (config → wiring) call these.
"""
