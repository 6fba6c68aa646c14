"""The RL maths and the RL-only components: advantages, losses, KL, algorithms, batches,
one training step, the reference policy and the critic.

Layer: above `training.backend`; the loop that drives these is `training.loops.rl`.
"""
