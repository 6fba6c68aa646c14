"""From samples to RL tensors: alignment of logprobs/advantages, masks, loss plumbing."""

import pytest
import torch

from rollouts.tasks.math import answers_match, extract_final_answer, math_correctness_reward
from rollouts.types import RolloutBatch, Sample
from training.data.packing import IGNORE_INDEX
from training.rl.algorithms import dapo, grpo
from training.rl.batch import build_examples, collate_rl, loss_weight_fn, rl_loss_fn


def sample(prompt, response, mask, logprobs, reward, g, i):
    return Sample(tuple(prompt), tuple(response), tuple(mask), tuple(logprobs), reward=reward,
                  group_id=g, index_in_group=i)  # fmt: skip


def test_engine_logprobs_and_advantages_sit_before_their_tokens():
    g0 = (sample([5, 6], [7, 8, 9], [1, 0, 1], [-0.1, 0.0, -0.3], 1.0, 0, 0),
          sample([5, 6], [7], [1], [-0.2], 0.0, 0, 1))  # fmt: skip
    batch = RolloutBatch((g0,), step_id=1, epoch_id=0)
    examples = build_examples(batch, grpo())
    assert [e.advantage for e in examples] == pytest.approx([0.70710677, -0.70710677], rel=1e-5)
    assert examples[0].input_ids == (5, 6, 7, 8, 9)
    assert examples[0].loss_mask == (0, 0, 1, 0, 1)
    assert examples[0].rollout_logprobs == (-0.1, -0.3)  # tool token (mask 0) left out
    rl = collate_rl(examples, pad_id=0)
    # row 0: position 1 predicts token 7, position 3 predicts token 9; token 8 is not trained
    assert rl.target_ids[0].tolist() == [IGNORE_INDEX, 7, IGNORE_INDEX, 9, IGNORE_INDEX]
    assert rl.rollout_logprobs_BT[0].tolist() == pytest.approx([0, -0.1, 0, -0.3, 0])
    assert rl.target_ids[1].tolist()[:3] == [IGNORE_INDEX, 7, IGNORE_INDEX]
    assert rl.advantages_B.tolist() == pytest.approx([0.70710677, -0.70710677], rel=1e-5)


def test_rl_loss_gradient_flows_only_through_trained_positions():
    g0 = (sample([5, 6], [7, 8, 9], [1, 0, 1], [-0.1, 0.0, -0.3], 1.0, 0, 0),
          sample([5, 6], [8, 7], [1, 1], [-0.2, -0.4], 0.0, 0, 1))  # fmt: skip
    examples = build_examples(RolloutBatch((g0,), 1, 0), grpo())
    rl = collate_rl(examples, pad_id=0)
    logits = torch.randn(*rl.target_ids.shape, 12, requires_grad=True)
    loss, metrics = rl_loss_fn(grpo(), temperature=1.0)(logits, rl)
    loss.backward()
    trained = rl.target_ids != IGNORE_INDEX
    assert logits.grad[~trained].abs().sum() == 0
    assert (logits.grad[trained].abs().sum(-1) > 0).all()
    assert {"loss", "clip_fraction", "logprob_diff_max_abs"} <= set(metrics)


def test_dapo_weights_micro_batches_by_tokens_and_grpo_by_sequences():
    class B:
        n_trained_tokens, n_samples = 10, 2

    assert loss_weight_fn(dapo(max_response_len=8))(B) == 10
    assert loss_weight_fn(grpo())(B) == 2


def test_math_answer_extraction_and_reward():
    assert extract_final_answer("so \\boxed{1,234} done") == "1,234"
    assert extract_final_answer("it costs $18.50 total") == "18.50"
    assert answers_match("1,234", "1234") and answers_match("18.0", "18")
    assert not answers_match("17", "18")
    s = Sample(
        (1,), (2,), (1,), response_text="The answer is \\boxed{72}.", metadata={"answer": "72"}
    )
    assert math_correctness_reward(s) == {"correct": 1.0, "total": 1.0}


async def test_online_dpo_trains_through_the_backend_with_a_reference(tiny_model_dir, tmp_path):
    from training.backend.pytorch import PyTorchTrainingBackend, load_model_and_tokenizer
    from training.config import OptimConfig
    from training.loops.rl import train_on_batch
    from training.rl.algorithms import online_dpo
    from training.rl.reference import make_reference

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    backend = PyTorchTrainingBackend(
        model, tok, optim=OptimConfig(lr=1e-3), max_steps=5, checkpoint_dir=tmp_path,
        pack_length=None, micro_batch_tokens=20,  # 2 pairs (one shared row each): must not split
        collate_fn=lambda ex: collate_rl(ex, pad_id=tok.pad_token_id),
    )  # fmt: skip
    groups = (
        *tuple(
            tuple(
                sample([5, 6, g], [7 + i, 9, 2], [1, 1, 1], [-1.0] * 3, float(i == 1), g, i)
                for i in range(3)
            )
            for g in range(4)
        ),
        (sample([5], [7], [1], [-1.0], 0.0, 4, 0), sample([5], [8], [1], [-1.0], 0.0, 4, 1)),
    )
    batch = RolloutBatch(groups, 1, 0)
    examples = build_examples(batch, online_dpo())
    assert len(examples) == 8  # best+worst of the 4 groups with a preference; tied group skipped
    assert [e.advantage for e in examples[:2]] == [1.0, -1.0] and examples[0].unit == 0
    with backend, make_reference(backend) as reference:
        metrics = await train_on_batch(backend, batch, online_dpo(), temperature=1.0,
                                       old_from_rollout=False, reference=reference)  # fmt: skip
    assert metrics["n_microbatches"] > 1
    assert metrics["num_pairs"] == 4  # every pair of the step (was averaged per micro-batch)
    assert metrics["grad_norm"] > 0
