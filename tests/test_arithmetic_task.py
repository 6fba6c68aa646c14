import json

from rollouts.tasks.arithmetic import (
    ArithmeticProblem,
    extract_answer,
    is_correct,
    make_problems,
    write_arithmetic_datasets,
)


def test_problems_are_deterministic_and_correct():
    a = make_problems(50, seed=1, min_digits=1, max_digits=3)
    assert a == make_problems(50, seed=1, min_digits=1, max_digits=3)
    assert a != make_problems(50, seed=2, min_digits=1, max_digits=3)
    for p in a:
        left, op, right = (
            p.question.partition("+") if "+" in p.question else p.question.partition("-")
        )
        assert int(p.answer) == (int(left) + int(right) if op == "+" else int(left) - int(right))


def test_answer_extraction_takes_last_integer():
    assert extract_answer("the answer is -12") == "-12"
    assert extract_answer("3 then 45") == "45"
    assert extract_answer("no digits") is None
    assert is_correct("= 168", "168") and not is_correct("167", "168") and not is_correct("", "1")


def test_held_out_split_is_disjoint_from_training(tmp_path):
    files = write_arithmetic_datasets(tmp_path, n_sft=300, n_rl=100, n_eval=50, seed=0)

    def questions(path, key):
        return {json.loads(line)[key][0]["content"] for line in path.read_text().splitlines()}

    held = questions(files.sft_eval, "messages")
    assert len(held) == 50
    assert held.isdisjoint(questions(files.sft_train, "messages"))
    assert held.isdisjoint(questions(files.rl_train, "messages"))
    assert questions(files.rl_eval, "messages") == held
    first = json.loads(files.rl_train.read_text().splitlines()[0])
    assert set(first) == {"messages", "answer"}


def test_held_out_split_takes_a_small_share_of_every_stratum_and_warns_when_it_cannot(
    tmp_path, caplog
):
    from rollouts.tasks.arithmetic import held_out_shares, write_arithmetic_datasets

    # A digit-stratified draw of 500 takes most of the 100 one-digit sums ...
    shares = held_out_shares(make_problems(500, seed=0, min_digits=1, max_digits=2, ops="+"))
    assert shares[(1, 1)] > 0.5 and shares[(2, 2)] < 0.05
    # ... the held-out split is drawn uniformly over questions instead: ~5% of each stratum.
    with caplog.at_level("WARNING", logger="rollouts.tasks"):
        files = write_arithmetic_datasets(tmp_path / "a", n_sft=10, n_rl=10, n_eval=500,
                                          min_digits=1, max_digits=2, ops="+")  # fmt: skip
    assert "held-out split takes" not in caplog.text
    held = [json.loads(line) for line in files.rl_eval.read_text().splitlines()]
    problems = [ArithmeticProblem(r["messages"][0]["content"], r["answer"]) for r in held]
    assert all(share < 0.12 for share in held_out_shares(problems).values())
    # A problem space too small for the split is flagged.
    with caplog.at_level("WARNING", logger="rollouts.tasks"):
        write_arithmetic_datasets(tmp_path / "b", n_sft=10, n_rl=10, n_eval=50, min_digits=1,
                                  max_digits=1, ops="+")  # fmt: skip
    assert "1+1-digit" in caplog.text


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_imperfect_teacher_drops_the_carry_in_its_share_of_carry_sums_and_nothing_else(tmp_path):
    from rollouts.tasks.arithmetic import dropped_carry

    files = write_arithmetic_datasets(tmp_path, n_sft=4000, n_rl=50, n_eval=50, min_digits=1,
                                      max_digits=2, ops="+", teacher_carry_error=0.7)  # fmt: skip
    carry = wrong = 0
    for r in _records(files.sft_train):
        question, given = r["messages"][0]["content"], r["messages"][1]["content"]
        left, right = map(int, question.split("+"))
        truth = ArithmeticProblem(question, str(left + right))
        slip = dropped_carry(truth)
        if slip is None:  # no units carry: the teacher is always right
            assert given == truth.answer, question
            continue
        carry += 1
        assert given in (truth.answer, slip) and int(slip) == left + right - 10, question
        wrong += given == slip
    assert carry > 1000 and 0.66 < wrong / carry < 0.74
    # The reward and the held-out split still know the truth.
    for r in _records(files.rl_train) + _records(files.rl_eval):
        left, right = map(int, r["messages"][0]["content"].split("+"))
        assert r["answer"] == str(left + right)
    for r in _records(files.sft_eval):
        left, right = map(int, r["messages"][0]["content"].split("+"))
        assert r["messages"][1]["content"] == str(left + right)


def test_a_perfect_teacher_writes_the_same_files_as_before_the_option_existed(tmp_path):
    kw = dict(n_sft=500, n_rl=50, n_eval=50, min_digits=1, max_digits=2, ops="+")
    plain = write_arithmetic_datasets(tmp_path / "a", **kw)
    perfect = write_arithmetic_datasets(tmp_path / "b", teacher_carry_error=0.0, **kw)
    assert plain.sft_train.read_bytes() == perfect.sft_train.read_bytes()
    for r in _records(perfect.sft_train):
        left, right = map(int, r["messages"][0]["content"].split("+"))
        assert r["messages"][1]["content"] == str(left + right)
