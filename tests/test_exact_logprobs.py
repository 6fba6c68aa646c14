"""Exact-logprobs mode (issue 46): the local engine returns each sampled token's logprob as the
trainer computes it, whatever shares its batch and whatever it took from the prefix cache, and a
GRPO run with `engines.exact_logprobs` measures no engine/trainer mismatch at all.

References are computed independently: the trainer's scorer on the tiny model loaded in this
process (`tiny_hf_model`), one sequence at a time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import trio
from pydantic import ValidationError

from engines.local import open_local_engine
from tests.distributed_launch import ROOT, launch
from tests.torchrun_exit import SMALL_EVAL_DATA, SMALL_RL_DATA
from training.data.exact_scoring import score_alone
from training.recipes.rl_engines import local_engine_args
from training.rl_config import RLRunConfig

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


def refusing_scorer(model, prompt_ids, output_ids, *, temperature):
    raise RuntimeError("this scorer refuses every sequence")


async def test_a_request_whose_rescoring_fails_fails_instead_of_returning_fast_logprobs(
    tiny_model_dir,
):
    scorer = "tests.test_exact_logprobs:refusing_scorer"
    async with (
        open_local_engine(tiny_model_dir, num_threads=1, exact_logprobs=True,
                          exact_logprobs_scorer=scorer, skip_server_warmup=True) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):  # fmt: skip
        body = {"input_ids": PROMPTS[0], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}  # fmt: skip
        response = await http.post("/generate", json=body)
        healthy = await http.get("/health_generate")
    assert response.status_code == 500
    assert "Exact logprob scoring failed" in response.text and "refuses" in response.text
    assert healthy.status_code == 200  # the engine keeps serving


async def test_an_unloadable_scorer_is_refused_at_start_naming_the_flag(tiny_model_dir):
    with pytest.raises(BaseExceptionGroup) as refused:
        async with open_local_engine(tiny_model_dir, num_threads=1, exact_logprobs=True,
                                     exact_logprobs_scorer="no_such_module:f"):  # fmt: skip
            pass
    assert refused.group_contains(ValueError, match="--exact-logprobs-scorer 'no_such_module:f'")


def test_exact_scores_do_not_depend_on_where_the_weights_sit_in_memory(tiny_model_dir):
    """FSDP2's gathered parameters sit at other offsets than a loaded model's; MKL's strict mode
    (`strict_blas`, which the exact mode turns on first thing) makes the float32 matrix products
    round the same wherever their operands sit (without it: 3 of these 50 differ here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MKL_CBWR", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "exact_alignment.py"),
                           str(tiny_model_dir), "--strict"], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "0/50"


# ----- a GRPO run with engines.exact_logprobs, through the recipe (config key -> launch flag) ----


def exact_run_args(model_dir: Path, out: Path, *, steps: int, temperature: float = 1.0,
                   prefix_cache: bool = True) -> list[str]:  # fmt: skip
    """`examples/run_rl.py` arguments: the tiny recipe, 4 prompts x 4 samples, exact mode."""
    return ["--config", str(ROOT / "configs" / "rl_tiny.yaml"), "--model", str(model_dir),
            "--output-dir", str(out / "rl"), "--max-steps", str(steps),
            "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.filter_groups=none",
            f"rollout.sampling.temperature={temperature}", "train.eval_samples=8",
            "train.eval_every=1000", "backend.num_threads=1", "engines.exact_logprobs=true",
            f"engines.local_prefix_cache={str(prefix_cache).lower()}",
            "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
            f"data.task_dir={out / 'data'}", SMALL_RL_DATA, SMALL_EVAL_DATA]  # fmt: skip


def step_diffs(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    return [r["logprob_diff_max_abs"] for r in rows]


def test_grpo_with_exact_logprobs_measures_no_mismatch_at_one_process(tiny_model_dir, tmp_path):
    proc = launch("examples/run_rl.py", *exact_run_args(tiny_model_dir, tmp_path, steps=3),
                  world=1, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_diffs(tmp_path) == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_grpo_with_exact_logprobs_measures_no_mismatch_under_fsdp2_at_two_ranks(
    tiny_model_dir, tmp_path, warm_python
):
    """The sharded trainer gathers each layer's full weights before its forward, so a sample's
    forward at two ranks is the one-process forward: still no mismatch."""
    args = exact_run_args(tiny_model_dir, tmp_path, steps=2, temperature=0.7)
    proc = launch("examples/run_rl.py", *args, world=2, cwd=tmp_path, warm=warm_python)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_diffs(tmp_path) == [0.0, 0.0]


# ----- the config key ------------------------------------------------------------------------


def test_exact_logprobs_turns_prompt_sharing_off_and_reaches_the_engine_as_its_flags():
    from engines.local.__main__ import build_parser

    exact = RLRunConfig(engines={"exact_logprobs": True, "local_prefix_cache": False})
    assert exact.train.share_prompts is False
    assert RLRunConfig().train.share_prompts is True  # the shared default is left alone
    for config, on in ((exact, True), (RLRunConfig(), False)):
        args = build_parser().parse_args(["--model-path", "m", *local_engine_args(config.engines)])
        assert (args.exact_logprobs, args.disable_radix_cache) == (on, on)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"engines": {"urls": ["http://h:30000"]}}, "engines.urls"),
        ({"engines": {"local_dtype": "bfloat16"}}, "engines.local_dtype"),
        ({"model": {"attention": "segments"}}, "model.attention"),
        ({"backend": {"fsdp": {"param_dtype": "bfloat16"}}}, "backend.fsdp.param_dtype"),
        ({"backend": {"fsdp": {"compile_layers": True}}}, "backend.fsdp.compile_layers"),
        ({"model": {"lora": {"rank": 4}}}, "model.lora"),
        ({"env": {"kind": "tools"}}, "env.kind"),
        ({"train": {"share_prompts": True}}, "train.share_prompts"),
    ],
)
def test_exact_logprobs_refuses_what_it_cannot_make_exact_and_names_the_key(overrides, named):
    engines = {"exact_logprobs": True, **overrides.pop("engines", {})}
    with pytest.raises(ValidationError, match=re.escape(named)):
        RLRunConfig(engines=engines, **overrides)
