"""The RL maths and the RL-only components: advantages (distillation's per-token ones too),
losses, KL, algorithms, batches, one training step, the reference policy and the critic.

Layer: above `training.backend`; the loop that drives these is `training.loops.rl`.
"""
