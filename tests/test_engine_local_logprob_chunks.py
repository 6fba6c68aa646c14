"""The local engine's prompt (input) logprobs are computed a chunk of positions at a time: the
same floats as the whole prompt at once, bit for bit, and never more than a chunk of float32
[positions x vocab] logprobs alive (a teacher scoring an 8,192-token prompt of a 152k
vocabulary held ~5 GB of them at once before).

Runs the engine's `ModelRunner` in this thread (a prefill with `return_logprob`,
`logprob_start_len` 0 and top-logprobs, as a teacher's scoring asks), so the dispatch mode that
records allocations sees its tensors.
"""

from __future__ import annotations

import pytest
from vocab_rows import VocabRows

from engines.local.params import GenerateItem
from engines.local.runner import ModelRunner
from engines.local.sampling_params import SamplingParams
from engines.local.sequence import Sequence

PROMPT = list(range(3, 63))  # 60 tokens: 59 scored positions, a prime
TOP = 5


def scoring(ids: list[int], start: int = 0) -> Sequence:
    """A teacher's scoring request: no new token, every prompt logprob and its top-5."""
    return Sequence(GenerateItem("score", ids, SamplingParams(max_new_tokens=0), True, start,
                                 TOP, False))  # fmt: skip


def prompt_logprobs(runner: ModelRunner, chunk: int, start: int = 0):
    runner.input_logprob_chunk = chunk
    out = runner.step([], [scoring(PROMPT, start)])
    assert not out.errors, out.errors
    return out.prefilled[0].input_logprobs, out.prefilled[0].input_top


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_logprobs_in_chunks_are_bit_identical_to_the_whole_prompt_at_once(
    tiny_model_dir, dtype
):
    runner = ModelRunner(str(tiny_model_dir), dtype=dtype)
    # one chunk of every position: the computation as it was, one [59, V] float32 at once
    whole = prompt_logprobs(runner, chunk=10**6)
    assert len(whole[0]) == len(PROMPT) and whole[0][0] is None and len(whole[1][1]) == TOP
    for chunk in (1, 7, 16, 59, 1024):  # 7 and 16 do not divide 59
        assert prompt_logprobs(runner, chunk) == whole, chunk
    # from a later start (`logprob_start_len`), as a distillation's response-only scoring
    late = prompt_logprobs(runner, chunk=10**6, start=40)
    assert prompt_logprobs(runner, chunk=3, start=40) == late
    assert late[0][1:] == whole[0][41:]


@pytest.mark.parametrize("chunk", [1, 8, 16])
def test_prompt_scoring_holds_at_most_a_chunk_of_float32_vocab_rows(tiny_model_dir, chunk):
    # bfloat16, as a GPU engine serves: the model's own logits are not float32, so every
    # float32 [rows, vocab] tensor of the request is the scoring's
    runner = ModelRunner(str(tiny_model_dir), dtype="bfloat16")
    with VocabRows(runner.vocab_size) as mode:
        values, tops = prompt_logprobs(runner, chunk)
    print(f"chunk {chunk}: at most {mode.most_rows} float32 vocab rows for "
          f"{len(PROMPT) - 1} scored positions")  # fmt: skip
    assert len(values) == len(PROMPT) and len(tops) == len(PROMPT)
    assert 0 < mode.most_rows <= chunk
