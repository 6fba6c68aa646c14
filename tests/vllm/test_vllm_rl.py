"""A short RL run against a real vLLM server (`make test-vllm`): weights pushed to vLLM after
every step, and vLLM's logprobs equal to the trainer's on the weights it was pushed."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from tests.rl_helpers import run_loop
from tests.test_engine_local import PROMPTS, teacher_forced
from tests.vllm.test_vllm_engine import LOGPROB_TOL, max_diff


async def test_rl_steps_push_weights_to_vllm_whose_logprobs_then_equal_the_trainers(
    vllm_engine, tiny_model_dir, tiny_hf_model, tmp_path
):
    run = await run_loop(vllm_engine, tiny_model_dir, tmp_path, max_steps=3)
    assert [row["step"] for row in run.history] == [1, 2, 3]
    # every step trained on samples vLLM generated on the weights pushed after the step before;
    # the loop compares their logprobs with the trainer's (before the update) on every token
    for row in run.history:
        print(f"step {row['step']}: loss {row['loss']:.4f}, engine vs trainer logprob "
              f"max |diff| {row['logprob_diff_max_abs']:.2e}")  # fmt: skip
        assert row["logprob_diff_max_abs"] <= LOGPROB_TOL
    assert vllm_engine.weight_version == str(run.backend.weight_version) == "3"
    assert (await vllm_engine.model_info()).weight_version == "3"

    # after the last push: fresh samples, scored by the trained policy in this process
    policy = run.backend.model.eval()
    for prompt in PROMPTS:
        result = await vllm_engine.generate(prompt, {"max_new_tokens": 12, "ignore_eos": True})
        trained = teacher_forced(policy, prompt, list(result.output_ids))
        initial = teacher_forced(tiny_hf_model, prompt, list(result.output_ids))
        diff = max_diff(result.output_logprobs, trained)
        print(
            f"prompt of {len(prompt)} tokens: vLLM vs trainer max |diff| {diff:.2e}; "
            f"vs the initial weights {max_diff(result.output_logprobs, initial):.2e}"
        )
        assert diff <= LOGPROB_TOL
        assert max_diff(result.output_logprobs, initial) > 100 * LOGPROB_TOL  # weights moved


async def test_the_rl_recipe_trains_against_vllm_given_by_url(
    vllm_engine, tiny_model_dir, tmp_path
):
    """`examples/run_rl.py --engine-url URL engines.kind=vllm`: probe, the model vLLM serves
    (no --model), a pool of `VLLMEngine`s, a push per step."""
    from tests.test_run_rl_cli import run_cli

    config = Path(__file__).parent.parent.parent / "configs" / "rl_tiny.yaml"
    proc = await trio.to_thread.run_sync(lambda: run_cli(
        "--config", str(config), "--engine-url", vllm_engine.url,
        "--output-dir", str(tmp_path / "out"), "--max-steps", "2", "engines.kind=vllm",
        "rollout.batch_size=2",
        "rollout.n_samples_per_prompt=2", "rollout.filter_groups=none", "train.eval_samples=8",
        "backend.num_threads=1", "reward.fn=rollouts.tasks.arithmetic:digit_share_reward",
        f"data.task_dir={tmp_path / 'data'}", cwd=tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("RL done: heldout_accuracy before=")
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    print(proc.stdout.strip().splitlines()[-1])
    for r in rows:
        print(f"recipe step {r['step']}: weight_version {r['weight_version']}, engine vs trainer "
              f"logprob max |diff| {r['logprob_diff_max_abs']:.2e}")  # fmt: skip
    assert [r["weight_version"] for r in rows] == [1, 2]
    assert all(r["logprob_diff_max_abs"] <= LOGPROB_TOL for r in rows)
    assert (await vllm_engine.model_info()).weight_version == "2"  # initial push, one per step
