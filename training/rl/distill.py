"""On-policy distillation: per-token advantages from a teacher's logprobs (pure functions).

The student π samples a response y; a teacher q scores the same tokens given the same
prefixes (rollouts/teacher.py puts q's logprobs on the sample). The objective is the reverse
KL, KL(π ‖ q) = E_{y~π} Σ_t [log π(y_t | y_<t) − log q(y_t | y_<t)], and its single-sample
estimate at each sampled token is k1_t = log π(y_t) − log q(y_t). Minimising it with the policy
gradient is RL with the per-token reward −k1_t, so each trained token's advantage is

    A_t = distill_coef × (log q(y_t) − log π(y_t))  [+ γ A_{t+1} with distill_discount γ > 0]
          + distill_reward_coef × A_task (the task reward's GRPO advantage of the sample),

positive where the teacher likes the token more than the student does. The same sign and the
undiscounted default are tinker-cookbook's (`distillation/train_on_policy.py`,
`incorporate_kl_penalty`: advantages += −kl_penalty_coef × (sampled − teacher logprobs),
kl_discount_factor 0) and slime's (`advantage_estimator == "on_policy_distillation"`:
teacher_log_probs − log_probs). log π is the engine's logprob of the sampled token (what
tinker uses; slime recomputes it with the trainer: equal up to engine/trainer mismatch on the
same weights). The distill advantages are not whitened (a KL of 0 stays 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

from rollouts.types import Sample
from training.rl.algorithm_config import AlgorithmConfig


def distill_token_advantages(student_lp: Sequence[float], teacher_lp: Sequence[float], *,
                             coef: float = 1.0, discount: float = 0.0) -> list[float]:  # fmt: skip
    """coef × (teacher − student) logprob per token, summed into the future with `discount`.

    Args:
        student_lp, teacher_lp: logprobs of the same trained tokens, in order.
        coef: weight of the reverse-KL term.
        discount: γ of the discounted future sum A_t = a_t + γ A_{t+1} (0: each token alone).
    """
    if len(student_lp) != len(teacher_lp):
        raise ValueError(
            f"{len(student_lp)} student logprobs for {len(teacher_lp)} teacher logprobs: both "
            "must score the same tokens"
        )
    out = [coef * (q - p) for p, q in zip(student_lp, teacher_lp, strict=True)]
    if discount > 0:
        for t in range(len(out) - 2, -1, -1):
            out[t] += discount * out[t + 1]
    return out


def sample_token_advantages(sample: Sample, task_advantage: float,
                            algorithm: AlgorithmConfig) -> tuple[float, ...]:  # fmt: skip
    """One advantage per trained token of `sample` (loss_mask 1), `algorithm` being distill's.

    Raises:
        ValueError: the sample has no teacher logprobs or no engine logprobs: a distillation
            sample is never trained without its teacher signal.
    """
    where = f"group {sample.group_id} sample {sample.index_in_group}"
    if not sample.teacher_logprobs:
        raise ValueError(
            f"{where}: no teacher logprobs, and {algorithm.name} (advantage=distill) trains on "
            "them: score the samples with a teacher (rollouts.teacher.with_teacher; the recipe "
            "does it when the config has a `teacher:` section)"
        )
    if not sample.rollout_logprobs:
        raise ValueError(f"{where}: no engine logprobs (return_logprob): the student's logprob "
                         "of each sampled token is half of the distillation signal")  # fmt: skip
    student = list(compress(sample.rollout_logprobs, sample.loss_mask))
    teacher = list(compress(sample.teacher_logprobs, sample.loss_mask))
    teacher_part = distill_token_advantages(student, teacher, coef=algorithm.distill_coef,
                                            discount=algorithm.distill_discount)  # fmt: skip
    return tuple(a + task_advantage for a in teacher_part)


def teacher_kl_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """ "teacher_kl": the mean over trained tokens of log π − log q (the reverse-KL estimate the
    advantages negate; 0 when student and teacher agree), "teacher_kl_max_seq": the largest
    per-sample mean. {} when no sample carries teacher logprobs."""
    total, count, worst = 0.0, 0, float("-inf")
    for s in samples:
        if not s.teacher_logprobs or not s.rollout_logprobs or not s.num_trained_tokens:
            continue
        diffs = [p - q for p, q, m in zip(s.rollout_logprobs, s.teacher_logprobs, s.loss_mask,
                                          strict=True) if m]  # fmt: skip
        total += sum(diffs)
        count += len(diffs)
        worst = max(worst, sum(diffs) / len(diffs))
    if not count:
        return {}
    return {"teacher_kl": total / count, "teacher_kl_max_seq": worst}
