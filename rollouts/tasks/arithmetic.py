"""Synthetic arithmetic task: deterministic problems, answer extraction and correctness reward.

The task is what the tiny model learns in the demo: SFT teaches the format and most answers,
RL (with the correctness reward) then improves accuracy. Problems are addition or subtraction of
integers with a configurable number of digits; the prompt is the bare expression ("123+45") and
the answer is the integer result ("168").

Everything here is pure and seeded: the same arguments always give the same files.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

_INT_RE = re.compile(r"-?\d+")
log = logging.getLogger("rollouts.tasks")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: the question shown to the model and the ground-truth answer."""

    question: str
    answer: str

    def messages(self) -> list[dict[str, str]]:
        """The prompt as a chat conversation (one user turn)."""
        return [{"role": "user", "content": self.question}]

    def sft_record(self) -> dict:
        """A chat-format SFT record with the correct answer as the assistant turn."""
        return {"messages": [*self.messages(), {"role": "assistant", "content": self.answer}]}

    def rl_record(self) -> dict:
        """An RL prompt record: the prompt messages and the ground truth for the reward."""
        return {"messages": self.messages(), "answer": self.answer}


def _low(digits: int) -> int:
    return 0 if digits == 1 else 10 ** (digits - 1)


def make_problem(
    rng: random.Random,
    *,
    min_digits: int = 1,
    max_digits: int = 3,
    ops: str = "+-",
    stratified: bool = True,
) -> ArithmeticProblem:
    """Draw one problem.

    `stratified`: each operand's digit count is uniform in [min_digits, max_digits], so short
    operands get as much practice as long ones (training draws). Otherwise every distinct
    question is equally likely (held-out draws: they then take the same small share of every
    digit stratum, and training still sees nearly all of the tiny 1-digit strata).
    """

    def operand() -> int:
        if not stratified:
            return rng.randint(_low(min_digits), 10**max_digits - 1)
        digits = rng.randint(min_digits, max_digits)
        return rng.randint(_low(digits), 10**digits - 1)

    a, b, op = operand(), operand(), rng.choice(ops)
    result = a + b if op == "+" else a - b
    return ArithmeticProblem(question=f"{a}{op}{b}", answer=str(result))


def make_problems(
    n: int,
    *,
    seed: int,
    min_digits: int = 1,
    max_digits: int = 3,
    ops: str = "+-",
    exclude: set[str] | frozenset[str] = frozenset(),
    distinct: bool = True,
    stratified: bool = True,
) -> list[ArithmeticProblem]:
    """Draw `n` problems whose questions are not in `exclude`, deterministically from `seed`.

    With `distinct`, no question repeats (held-out sets); without, training sets may repeat
    questions, as a small problem space (2-digit numbers) requires. `stratified`: see
    `make_problem`.
    """
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[ArithmeticProblem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(
                f"cannot draw {n} problems with {min_digits}-{max_digits} digits and ops "
                f"{ops!r} outside the {len(exclude)} excluded ones: the problem space is too small"
            )
        problem = make_problem(
            rng, min_digits=min_digits, max_digits=max_digits, ops=ops, stratified=stratified
        )
        if problem.question not in seen:
            if distinct:
                seen.add(problem.question)
            out.append(problem)
    return out


def extract_answer(text: str) -> str | None:
    """The last integer in `text` (the model's final answer), or None when there is none."""
    matches = _INT_RE.findall(text)
    return matches[-1] if matches else None


def is_correct(completion: str, answer: str) -> bool:
    """Exact match of the extracted integer against the ground truth."""
    extracted = extract_answer(completion)
    return extracted is not None and int(extracted) == int(answer)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    """Write one JSON object per line (atomically: temp file, then rename).

    The temp name is per process, so two runs writing the same dataset at once both succeed.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def dropped_carry(problem: ArithmeticProblem) -> str | None:
    """The answer a teacher who forgets the units carry writes, or None when there is none.

    Only sums of non-negative operands whose units digits add up to 10 or more have one:
    "57+38" -> "85" (the right answer is 95). This is the classic arithmetic slip, so a
    teacher that makes it is wrong in a realistic, systematic way rather than at random.
    """
    a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)", problem.question).groups()
    if op != "+" or int(a[-1]) + int(b[-1]) < 10:
        return None
    return str(int(a) + int(b) - 10)


def teacher_record(problem: ArithmeticProblem, rng: random.Random, carry_error: float) -> dict:
    """An SFT record as an imperfect teacher writes it.

    With probability `carry_error` a problem with a units carry gets the carry-dropped answer
    (`dropped_carry`); everything else is answered right. The reward still checks the truth.
    """
    wrong = dropped_carry(problem)
    if wrong is not None and rng.random() < carry_error:
        return ArithmeticProblem(problem.question, wrong).sft_record()
    return problem.sft_record()


def held_out_shares(problems: list[ArithmeticProblem], n_ops: int = 1
                    ) -> dict[tuple[int, int], float]:  # fmt: skip
    """Share of each operand-digit stratum (e.g. 1+1 digits: 100 problems per op) in `problems`.

    1-digit operands include 0, so 1-digit strata are tiny: 500 held-out problems of 1-2 digits
    take ~76 of the 100 one-digit sums, which training then never sees.
    """

    def size(digits: int) -> int:
        return 10**digits - _low(digits)

    counts: dict[tuple[int, int], int] = {}
    for p in problems:
        a, b = _INT_RE.findall(p.question)[:2]
        key = (len(a.lstrip("-")), len(b.lstrip("-")))
        counts[key] = counts.get(key, 0) + 1
    return {k: c / (size(k[0]) * size(k[1]) * n_ops) for k, c in counts.items()}


@dataclass(frozen=True)
class ArithmeticFiles:
    sft_train: Path
    sft_eval: Path
    rl_train: Path
    rl_eval: Path


def write_arithmetic_datasets(
    out_dir: str | Path,
    *,
    n_sft: int = 20000,
    n_rl: int = 4000,
    n_eval: int = 500,
    seed: int = 0,
    min_digits: int = 1,
    max_digits: int = 3,
    ops: str = "+-",
    teacher_carry_error: float = 0.0,
) -> ArithmeticFiles:
    """Write SFT (chat) and RL (prompt + answer) JSONL files with a shared held-out split.

    `teacher_carry_error`: the SFT demonstrations come from an imperfect teacher that drops
    the units carry of that share of the sums that have one (`teacher_record`); the RL prompts
    and the held-out files always carry the true answer. 0 is a perfect teacher.

    The held-out problems are drawn first, uniformly over the distinct questions, and excluded
    from both training sets, so eval accuracy measures generalisation, not memorisation. A
    digit-stratified held-out draw would instead take most of the 100 one-digit sums, which
    training then never sees (and RL on 2-digit sums makes the model worse at).
    """
    out = Path(out_dir)
    kwargs = dict(min_digits=min_digits, max_digits=max_digits, ops=ops)
    held_out = make_problems(n_eval, seed=seed, stratified=False, **kwargs)
    for stratum, share in held_out_shares(held_out, len(ops)).items():
        if share > 0.25:
            log.warning(
                "held-out split takes %.0f%% of all %s-digit problems: training sees too few "
                "of them to learn them, so they drag held-out accuracy down (use more digits "
                "or a smaller n_eval)", 100 * share, "+".join(map(str, stratum)),
            )  # fmt: skip
    excluded = {p.question for p in held_out}
    train = make_problems(n_sft + n_rl, seed=seed + 1, exclude=excluded, distinct=False, **kwargs)
    sft, rl = train[:n_sft], train[n_sft:]
    teacher = random.Random(seed + 2)
    return ArithmeticFiles(
        sft_train=write_jsonl(
            out / "sft_train.jsonl", [teacher_record(p, teacher, teacher_carry_error) for p in sft]
        ),
        sft_eval=write_jsonl(out / "sft_eval.jsonl", [p.sft_record() for p in held_out]),
        rl_train=write_jsonl(out / "rl_train.jsonl", [p.rl_record() for p in rl]),
        rl_eval=write_jsonl(out / "rl_eval.jsonl", [p.rl_record() for p in held_out]),
    )


def correctness_reward(sample) -> dict[str, float]:
    """RL reward: 1 when the response's last integer equals `metadata["answer"]`, else 0.

    Returned as a vector reward ({"correct", "total"}) so accuracy shows up in rollout metrics.
    """
    correct = float(is_correct(sample.response_text, str(sample.metadata["answer"])))
    return {"correct": correct, "total": correct}


def digit_share_reward(sample) -> float:
    """Format shaping: the share of the response's characters that are digits (0 to 1).

    Has spread even for an untrained model, so it is what smoke tests and the embedding
    example train on; the correctness reward is what the demo trains on.
    """
    text = sample.response_text
    return sum(c.isdigit() for c in text) / max(1, len(text))


def digit_match_reward(sample) -> dict[str, float]:
    """Correctness plus partial credit: the share of answer digits right, aligned from the end.

    `total = correct + 0.5 * digits` where `digits` is the share of the ground truth's digit
    positions (units, tens, ...) that the extracted answer gets right, counting missing or
    extra digits as wrong. A group whose samples are all wrong still has spread when some get
    more digits right, so it still teaches; exact match stays worth twice a near miss.
    """
    answer = str(sample.metadata["answer"])
    extracted = extract_answer(sample.response_text)
    correct = float(extracted is not None and int(extracted) == int(answer))
    if extracted is None:
        return {"correct": 0.0, "digits": 0.0, "total": 0.0}
    want, got = answer.lstrip("-")[::-1], extracted.lstrip("-")[::-1]
    same = sum(a == b for a, b in zip(want, got, strict=False))
    digits = same / max(len(want), len(got))
    return {"correct": correct, "digits": digits, "total": correct + 0.5 * digits}
