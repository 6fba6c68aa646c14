"""Exact-logprobs mode (issue 46): the local engine returns each sampled token's logprob as the
trainer computes it, whatever shares its batch and whatever it took from the prefix cache, and a
GRPO run with `engines.exact_logprobs` measures no engine/trainer mismatch at all.

References are computed independently: the trainer's scorer on the tiny model loaded in this
process (`tiny_hf_model`), one sequence at a time."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio

from engines.local import open_local_engine
from training.data.exact_scoring import score_alone

# prompts sharing a long prefix (the radix cache serves it) and of different lengths (padding)
PREFIX = list(range(10, 40))
PROMPTS = [PREFIX + [50 + i] * (1 + i % 3) for i in range(6)] + [list(range(60, 64))]


async def _sample_all(url: str, temperature: float) -> tuple[list, int]:
    """Every prompt twice, all requests at once (one shared batch), n=2 each: the (prompt,
    output ids, output logprobs) and the prompt tokens served from the prefix cache."""
    results = []
    cached = 0

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def one(ids: list[int]) -> None:
            body = {"input_ids": ids, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 8, "temperature": temperature,
                                        "ignore_eos": True, "n": 2}}  # fmt: skip
            response = await http.post("/generate", json=body)
            assert response.status_code == 200, response.text
            nonlocal cached
            for out in response.json():
                cached += out["meta_info"]["cached_tokens"]
                lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                results.append((ids, out["output_ids"], lps))

        for _ in range(2):  # the second round finds the prompts in the prefix cache
            async with trio.open_nursery() as nursery:
                for ids in PROMPTS:
                    nursery.start_soon(one, ids)
    return results, cached


def _max_diff_to_trainer(model, results, temperature: float) -> float:
    worst = 0.0
    with torch.inference_mode():
        for prompt, output, got in results:
            want = score_alone(model, prompt, output, temperature=temperature)
            worst = max(worst, *(abs(a - b) for a, b in zip(got, want, strict=True)))
    return worst


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_exact_mode_returns_the_trainers_logprob_of_each_token_whatever_its_batch(
    tiny_model_dir, tiny_hf_model, temperature
):
    async with open_local_engine(tiny_model_dir, num_threads=1, exact_logprobs=True) as server:
        results, cached = await _sample_all(server.url, temperature)
    assert cached > 0, "the second round should reuse the prefix cache"
    assert _max_diff_to_trainer(tiny_hf_model, results, temperature) == 0.0
