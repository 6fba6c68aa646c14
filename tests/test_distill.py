"""Issue 46 item 2: on-policy distillation. The student samples, a teacher engine scores the same
tokens over HTTP, and each sampled token's advantage is teacher − student logprob. Real local
engines in-process; faults from the fault proxy."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import trio
from rl_helpers import prompts, run_loop

from engines import SGLangEngine, find_free_port
from engines.local import open_local_engine
from engines.testing.fault_proxy import FaultPlan, FaultProxy
from plumbing.errors import ConfigError, RolloutsError
from rollouts.config import RolloutConfig, SamplingConfig
from rollouts.generate_fn import single_turn_generate
from rollouts.groups import keep_if_student_errs
from rollouts.manager import AsyncRolloutManager
from rollouts.teacher import with_teacher
from rollouts.types import Sample
from training.backend.pytorch import load_tokenizer
from training.config import load_config
from training.data.buffer import DataBuffer
from training.recipes.teacher import check_same_tokenizer, open_teacher
from training.rl.algorithms import compute_policy_loss, distill
from training.rl.batch import build_examples
from training.rl.distill import distill_token_advantages
from training.rl_config import RLRunConfig
from training.teacher_config import TeacherSection

ROLLOUT = RolloutConfig(batch_size=2, n_samples_per_prompt=2, filter_groups="none",
                        sampling=SamplingConfig(max_new_tokens=4))  # fmt: skip


def zero_reward(sample) -> float:
    return 0.0


async def raw_input_logprobs(url: str, ids: list[int], start: int) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= start, by a plain HTTP /generate (not the client)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": start - 1}  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        answer = (await http.post(f"{url}/generate", json=body)).json()
    entries = answer["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and [e[1] for e in entries[1:]] == ids[start:]
    return [e[0] for e in entries[1:]]


async def distill_batch(student_url: str, teacher, tokenizer, rollout=ROLLOUT, **teacher_kw):
    buffer = DataBuffer(prompts(tokenizer), seed=0)
    generate = with_teacher(single_turn_generate, teacher, **teacher_kw)
    async with SGLangEngine(student_url, max_retries=0) as student:
        manager = AsyncRolloutManager(student, buffer, rollout, reward_fn=zero_reward,
                                      generate_fn=generate)  # fmt: skip
        return await manager.generate_batch()


async def test_distill_advantage_is_teacher_minus_student_logprob_of_each_sampled_token(
    tiny_model_dir, tiny_model_dir_seed1
):
    tok = load_tokenizer(tiny_model_dir)
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as student,
        open_local_engine(tiny_model_dir_seed1, num_threads=1) as teacher_server,
        SGLangEngine(teacher_server.url, max_retries=0) as teacher,
    ):
        batch = await distill_batch(student.url, teacher, tok)
        examples = build_examples(batch, distill(distill_coef=0.5))
        assert len(examples) == len(batch.samples) == 4
        for sample, example in zip(batch.samples, examples, strict=True):
            ids, start = list(sample.prompt_ids + sample.response_ids), len(sample.prompt_ids)
            # both halves scored again, independently, by each engine over plain HTTP
            teacher_lp = await raw_input_logprobs(teacher_server.url, ids, start)
            student_lp = await raw_input_logprobs(student.url, ids, start)
            expected = [0.5 * (q - p) for p, q in zip(student_lp, teacher_lp, strict=True)]
            assert example.token_advantages == pytest.approx(expected, abs=1e-4)
            assert max(abs(a) for a in expected) > 0.05  # two different models: a real signal


def test_distill_discount_sums_each_tokens_future_advantages():
    a = distill_token_advantages([-1.0, -2.0, -3.0], [-1.5, -1.0, -3.5], coef=2.0, discount=0.5)
    # per token: 2 × (q − p) = −1, 2, −1; then A_t = a_t + 0.5 A_{t+1}
    assert a == pytest.approx([-1 + 0.5 * (2 + 0.5 * -1), 2 + 0.5 * -1, -1])


def recording_loss(seen: list[float]):
    def loss_fn(config, logprobs_BT, old_BT, advantages_B, mask_BT, **kw):
        seen.append(advantages_B[mask_BT.bool()].abs().max().item())
        return compute_policy_loss(config, logprobs_BT, old_BT, advantages_B, mask_BT, **kw)

    return loss_fn


@pytest.mark.parametrize("same", [True, False], ids=["same-teacher", "other-teacher"])
async def test_distill_advantages_vanish_when_the_teacher_is_the_student(
    tiny_model_dir, tiny_model_dir_seed1, tmp_path, same
):
    # The reverse KL of two equal models is 0: a teacher on the student's own weights gives
    # advantages ~0 (float noise between two engines); a different teacher does not. Adam is
    # scale-invariant: it turns even 1e-6 advantages into lr-sized steps (at lr 1e-3 the student
    # was 0.14 nats/token from its teacher at step 2), so the student moves by 1e-6 here.
    teacher_dir = tiny_model_dir if same else tiny_model_dir_seed1
    seen: list[float] = []
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as student_server,
        open_local_engine(teacher_dir, num_threads=1) as teacher_server,
        SGLangEngine(student_server.url, max_retries=0) as student,
        SGLangEngine(teacher_server.url, max_retries=0) as teacher,
    ):
        run = await run_loop(student, tiny_model_dir, tmp_path, max_steps=2,
                             algorithm=distill(), reward_fn=zero_reward,
                             generate_fn=with_teacher(single_turn_generate, teacher), lr=1e-6,
                             policy_loss_fn=recording_loss(seen))  # fmt: skip
    kls = [m["teacher_kl"] for m in run.history]
    print(f"teacher {'=' if same else '!='} student: max |A| per update {seen}, KL {kls}")
    assert len(seen) == 2 and len(kls) == 2
    # equal rewards (all 0) are no reason to call a distillation step signal-less
    assert not any(m.get("no_signal") or m.get("groups_equal_reward") for m in run.history)
    if same:  # step 1: the very same weights; step 2: one Adam step of 1e-6 away
        assert seen[0] < 1e-4 and abs(kls[0]) < 1e-5
        assert seen[1] < 1e-2 and abs(kls[1]) < 1e-3
    else:
        assert min(seen) > 0.1 and min(kls) > 0.01


def renamed_tokenizer_copy(model_dir: Path, out: Path) -> Path:
    """A copy of the model whose tokenizer calls id 2 '<|end|>' instead of '<|im_end|>'."""
    shutil.copytree(model_dir, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        path = out / name
        if path.exists():
            path.write_text(path.read_text().replace("<|im_end|>", "<|end|>"))
    return out


async def test_a_teacher_with_another_tokenizer_is_refused_naming_the_first_differing_token(
    tiny_model_dir, tmp_path
):
    other = renamed_tokenizer_copy(tiny_model_dir, tmp_path / "teacher")
    with pytest.raises(ConfigError) as err:
        check_same_tokenizer(str(tiny_model_dir), str(other))
    message = str(err.value)
    print(message)
    assert str(tiny_model_dir) in message and str(other) in message
    assert "token id 2 is '<|im_end|>' for the student and '<|end|>' for the teacher" in message
    # the recipe's teacher refuses it before launching an engine on it
    with pytest.raises(ConfigError, match="differs from the student's"), trio.fail_after(30):
        async with open_teacher(TeacherSection(model=str(other)), str(tiny_model_dir), tmp_path):
            pass
    assert not (tmp_path / "teacher_engine.log").exists()
    check_same_tokenizer(str(tiny_model_dir), str(tiny_model_dir))  # the same one passes


def test_distill_config_needs_a_teacher_and_refuses_unknown_teacher_keys(tmp_path):
    with pytest.raises(ConfigError, match="distill needs a teacher: set teacher.model"):
        load_config(RLRunConfig, None, ["algorithm.preset=distill"])
    yaml = tmp_path / "distill.yaml"
    yaml.write_text("algorithm:\n  preset: distill\nteacher:\n  model: some/dir\n  timout_s: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(RLRunConfig, yaml)
    assert str(yaml) in str(err.value) and "teacher.timout_s" in str(err.value)
    with pytest.raises(ConfigError, match="give model .* or engine_url"):
        load_config(RLRunConfig, None, ["algorithm.preset=distill", "teacher.model=a",
                                        "teacher.engine_url=http://x"])  # fmt: skip
    with pytest.raises(ConfigError, match="temperature 1.0"):
        load_config(RLRunConfig, None, ["algorithm.preset=distill", "teacher.model=a",
                                        "rollout.sampling.temperature=0.7"])  # fmt: skip
    ok = load_config(RLRunConfig, None, ["algorithm.preset=distill", "teacher.model=a",
                                         "algorithm.overrides.distill_reward_coef=0.5"])  # fmt: skip
    assert ok.teacher.timeout_s == 60.0


def test_a_teacher_signal_filter_that_would_do_nothing_is_refused():
    distill_run = ["algorithm.preset=distill", "teacher.model=a",
                   "algorithm.overrides.distill_filter_nats=1.0"]  # fmt: skip
    with pytest.raises(ConfigError, match="filter_groups: none .*it would do nothing"):
        load_config(RLRunConfig, None, [*distill_run, "rollout.filter_groups=none"])
    with pytest.raises(ValueError, match="advantage='grpo' has no teacher"):
        distill(advantage="grpo", distill_filter_nats=1.0)
    assert load_config(RLRunConfig, None, distill_run).rollout.filter_groups == "auto"


async def teacher_behind_proxy(nursery, model_dir, plan: FaultPlan) -> tuple[FaultProxy, str]:
    server = await nursery.start(_serve, model_dir)
    proxy = FaultProxy(server.url, plan)
    return proxy, await nursery.start(proxy.serve)


async def _serve(model_dir, *, task_status=trio.TASK_STATUS_IGNORED):
    async with open_local_engine(model_dir, num_threads=1, port=find_free_port()) as server:
        task_status.started(server)
        await trio.sleep_forever()


async def test_a_teacher_that_answers_500_fails_its_groups_as_an_engine_fault_naming_it(
    tiny_model_dir, tmp_path
):
    tok = load_tokenizer(tiny_model_dir)
    async with trio.open_nursery() as nursery:
        proxy, url = await teacher_behind_proxy(nursery, tiny_model_dir,
                                                FaultPlan(rates={"500": 1.0}))  # fmt: skip
        section = TeacherSection(engine_url=url, timeout_s=4.0)  # the recipe's teacher
        async with (
            open_local_engine(tiny_model_dir, num_threads=1) as student,
            open_teacher(section, str(tiny_model_dir), tmp_path) as teacher,
        ):
            with pytest.raises(RolloutsError) as err, trio.fail_after(60):
                await distill_batch(student.url, teacher.pool, tok, name=teacher.url,
                                    timeout_s=teacher.timeout_s)  # fmt: skip
        nursery.cancel_scope.cancel()
    message = str(err.value)
    print(message)
    # every group: generated, refused by the teacher (its pool retrying for 2 s), generated
    # again (sample_retries=1), dropped: counted by the teacher's URL and the cause
    assert f"teacher {url}: HTTP 500" in message and "max_failed_group_rate" in message
    assert proxy.counts["500"] >= 2 * 2 * 2  # 2 groups x 2 samples x (first try + 1 retry)


async def test_a_hung_teacher_is_given_up_after_its_timeout_and_the_group_generated_again(
    tiny_model_dir, tmp_path
):
    tok = load_tokenizer(tiny_model_dir)
    async with trio.open_nursery() as nursery:
        # the first scoring request hangs (60 s); everything after it is forwarded
        proxy, url = await teacher_behind_proxy(
            nursery, tiny_model_dir, FaultPlan(script=("hang",), hang_s=60.0))  # fmt: skip
        async with (
            open_local_engine(tiny_model_dir, num_threads=1) as student,
            open_teacher(TeacherSection(engine_url=url, timeout_s=2.0), str(tiny_model_dir),
                         tmp_path) as teacher,
        ):  # fmt: skip
            t0 = trio.current_time()
            with trio.fail_after(40):
                batch = await distill_batch(student.url, teacher.pool, tok,
                                            timeout_s=teacher.timeout_s)  # fmt: skip
            took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    print(f"hung teacher: batch in {took:.1f} s, metrics {dict(batch.metrics)}")
    assert proxy.counts["hang"] == 1
    assert batch.metrics["samples_retried"] >= 1  # the hung group's samples, generated again
    assert len(batch.samples) == 4
    assert all(len(s.teacher_logprobs) == len(s.response_ids) for s in batch.samples)
    assert took < 30  # bounded by teacher.timeout_s (2 s), not the proxy's 60 s hang


def _scored(lp: list[float], teacher: list[float], mask: list[int]) -> Sample:
    return Sample(prompt_ids=(5, 6), response_ids=tuple(range(10, 10 + len(lp))),
                  loss_mask=tuple(mask), rollout_logprobs=tuple(lp),
                  teacher_logprobs=tuple(teacher))  # fmt: skip


def test_the_teacher_signal_filter_keeps_a_group_only_for_a_token_the_student_overrates():
    overrated = _scored([-0.1, -0.2], [-0.1, -1.3], [1, 1])  # token 2: 1.1 nats likelier to π
    agreeing = _scored([-0.1, -0.2], [-0.15, -0.6], [1, 1])  # at most 0.4 nats
    underrated = _scored([-3.0, -0.2], [-0.01, -0.2], [1, 1])  # the teacher likes it more
    tool_token = _scored([-0.1, -0.2], [-0.1, -5.0], [1, 0])  # 4.8 nats, but not trained
    unscored = Sample(prompt_ids=(5,), response_ids=(7,), loss_mask=(1,), rollout_logprobs=(-0.1,))
    assert keep_if_student_errs((agreeing, overrated), nats=1.0)
    assert not keep_if_student_errs((agreeing, underrated, tool_token, unscored), nats=1.0)
    assert not keep_if_student_errs((overrated,), nats=1.2)


async def test_distill_with_the_teacher_signal_filter_trains_only_groups_with_an_overrated_token(
    tiny_model_dir, tiny_model_dir_seed1
):
    """`algorithm.distill_filter_nats` under `rollout.filter_groups: auto`: every group of the
    batch has a trained token the student rates `nats` above the teacher, by both engines'
    logprobs scored again over plain HTTP, and the groups without one were dropped."""
    tok = load_tokenizer(tiny_model_dir)
    rollout = ROLLOUT.model_copy(update={"filter_groups": "auto", "batch_size": 2})
    nats = 0.3
    async with (
        open_local_engine(tiny_model_dir, num_threads=1) as student_server,
        open_local_engine(tiny_model_dir_seed1, num_threads=1) as teacher_server,
        SGLangEngine(teacher_server.url, max_retries=0) as teacher,
        SGLangEngine(student_server.url, max_retries=0) as student,
    ):
        manager = AsyncRolloutManager(student, DataBuffer(prompts(tok), seed=0), rollout,
                                      reward_fn=zero_reward,
                                      generate_fn=with_teacher(single_turn_generate, teacher))  # fmt: skip
        manager.use_algorithm(distill(distill_filter_nats=nats))
        batch = await manager.generate_batch()
        worst = []
        for group in batch.groups:
            gaps = []
            for s in group:
                ids, start = list(s.prompt_ids + s.response_ids), len(s.prompt_ids)
                q = await raw_input_logprobs(teacher_server.url, ids, start)
                p = await raw_input_logprobs(student_server.url, ids, start)
                gaps += [a - b for a, b in zip(p, q, strict=True)]
            worst.append(max(gaps))
        manager.use_algorithm(distill(distill_filter_nats=50.0))  # no token is 50 nats off
        none_kept = await manager.generate_batch()
    print(f"largest log p − log q per kept group {worst}; metrics {batch.metrics}")
    assert len(batch.groups) == 2 and min(worst) >= nats - 1e-4
    assert not none_kept.groups and none_kept.metrics["groups_filtered"] >= 2
