"""PyTorchTrainingBackend: ordered futures, non-blocking, micro-batching, checkpoints."""

import pytest
import torch
import trio

from rollouts.errors import CheckpointError, ModelLoadError
from rollouts.tasks.arithmetic import make_problems
from training.backend.checkpoint import LATEST, find_latest_checkpoint, list_checkpoints
from training.backend.pytorch import BackendError, PyTorchTrainingBackend, load_model_and_tokenizer
from training.config import OptimConfig
from training.data.tokenize import TokenizedSample, tokenize_conversation


@pytest.fixture(scope="module")
def samples(tiny_tokenizer):
    problems = make_problems(96, seed=5, min_digits=1, max_digits=3)
    return [tokenize_conversation(tiny_tokenizer, p.sft_record()["messages"]) for p in problems]


def make_backend(model_dir, tmp_path, **kw):
    model, tok = load_model_and_tokenizer(model_dir)
    kw.setdefault("optim", OptimConfig(lr=1e-3, warmup_steps=2))
    return PyTorchTrainingBackend(model, tok, max_steps=20, checkpoint_dir=tmp_path / "ckpt", **kw)


async def test_queued_calls_run_in_order_and_bump_versions(tiny_model_dir, tmp_path, samples):
    with make_backend(tiny_model_dir, tmp_path) as backend:
        futs = [backend.forward_backward(samples[:16]), backend.optim_step()]
        futs += [backend.forward_backward(samples[16:32]), backend.optim_step()]
        results = [await f.result() for f in futs]
    assert results[1]["step"] == 1 and results[3]["step"] == 2
    assert backend.weight_version == 2
    assert results[0]["loss"] > 0 and results[1]["grad_norm"] > 0
    assert results[0]["n_trained_tokens"] == sum(s.n_trained for s in samples[:16])


async def test_event_loop_keeps_ticking_during_forward_backward(tiny_model_dir, tmp_path, samples):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.002)

    with make_backend(tiny_model_dir, tmp_path) as backend:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0)
            before = ticks
            await backend.forward_backward(samples * 2).result()
            nursery.cancel_scope.cancel()
    assert ticks - before >= 5


async def test_gradient_does_not_depend_on_micro_batch_size(tiny_model_dir, tmp_path, samples):
    grads = []
    metrics = []
    for budget in (64, 100_000):
        with make_backend(tiny_model_dir, tmp_path, micro_batch_tokens=budget) as backend:
            m = await backend.forward_backward(samples[:40]).result()
            metrics.append(m)
            grads.append(torch.cat([p.grad.flatten() for p in backend.model.parameters()]))
            if budget == 64:
                assert m["n_microbatches"] > 1
    # every metric (loss, loss_sum, counts), but those of the split itself
    split = {"n_microbatches", "padding_efficiency", "time_forward_backward_s"}
    assert metrics[0].keys() == metrics[1].keys() and "loss_sum" in metrics[0]
    for key in metrics[0].keys() - split:
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5), key
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_packed_rows_are_split_into_equal_micro_batches(tiny_model_dir, tmp_path):
    """16 packed rows at 15 rows per micro-batch are 8 + 8, not 15 + 1: as few micro-batches
    as filling each, as equal as whole rows allow (a 1-row pass costs a pass of per-micro-batch
    kernel launches, and a shape of its own to compile)."""
    sample = TokenizedSample(tuple(range(5, 21)), (0,) * 4 + (1,) * 12, "equal")
    with make_backend(tiny_model_dir, tmp_path, pack_length=64,
                      micro_batch_tokens=15 * 64) as backend:  # fmt: skip
        assert [len(mb) for mb in backend.split_microbatches([sample] * 64)] == [32, 32]
        for n in range(1, 80):
            sizes = [len(mb) for mb in backend.split_microbatches([sample] * n)]
            assert len(sizes) == -(-n // 60) and max(sizes) - min(sizes) <= 4, (n, sizes)


async def test_failed_operation_refuses_later_ones(tiny_model_dir, tmp_path, samples):
    with make_backend(tiny_model_dir, tmp_path) as backend:
        bad = backend.forward_backward([object()])
        step = backend.optim_step()
        with pytest.raises(TypeError):
            await bad.result()
        with pytest.raises(BackendError, match="earlier backend operation failed"):
            await step.result()


async def test_a_closed_backend_refuses_work_with_a_clear_error(tiny_model_dir, tmp_path, samples):
    backend = make_backend(tiny_model_dir, tmp_path)
    await backend.forward_backward(samples[:4]).result()
    backend.close()
    backend.close()  # idempotent: a `with` block around an explicit close() is fine
    with pytest.raises(BackendError, match=r"closed \(close\(\)\)"):
        backend.optim_step()


async def test_checkpoints_are_complete_pruned_and_reload(tiny_model_dir, tmp_path, samples):
    with make_backend(tiny_model_dir, tmp_path, keep_last=2) as backend:
        for step in range(1, 4):
            await backend.forward_backward(samples[:8]).result()
            await backend.optim_step().result()
            path = await backend.save_checkpoint(step, {"loss": 1.0}, extra_state={"k": step})
        weights = {k: v.clone() for k, v in backend.model.state_dict().items()}
    ckdir = tmp_path / "ckpt"
    assert [p.name for p in list_checkpoints(ckdir)] == ["step_000002", "step_000003"]
    assert find_latest_checkpoint(ckdir) == path
    assert (ckdir / LATEST).read_text().strip() == "step_000003"
    assert not [p for p in ckdir.iterdir() if p.name.startswith(".")]  # no temp dirs left
    reloaded, _ = load_model_and_tokenizer(path)  # HF layout: from_pretrained works
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, weights[k]), k

    with make_backend(tiny_model_dir, tmp_path / "other") as fresh:
        extra = await fresh.load_checkpoint(ckdir)
        assert extra == {"k": 3} and fresh.step == 3 and fresh.weight_version == 3
        for k, v in fresh.model.state_dict().items():
            assert torch.equal(v, weights[k]), k


async def test_loading_a_missing_checkpoint_names_the_path(tiny_model_dir, tmp_path):
    with (
        make_backend(tiny_model_dir, tmp_path) as backend,
        pytest.raises(CheckpointError, match="no checkpoint at .*nowhere"),
    ):
        await backend.load_checkpoint(tmp_path / "nowhere")


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="missing_model: no such directory"):
        load_model_and_tokenizer(tmp_path / "missing_model")


async def test_compute_logprobs_matches_a_plain_forward(tiny_model_dir, tmp_path, samples):
    with make_backend(tiny_model_dir, tmp_path, micro_batch_tokens=128) as backend:
        got = await backend.compute_logprobs(samples[:10]).result()
        model = backend.model
        for sample, lp in zip(samples[:10], got, strict=True):
            ids = torch.tensor([sample.input_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, :-1]
            full = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            trained = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
            torch.testing.assert_close(lp, full[trained], rtol=0, atol=1e-5)


async def test_the_loss_reads_the_batch_the_model_read(tiny_model_dir, tmp_path, samples,
                                                       monkeypatch):  # fmt: skip
    """The loss gets the micro-batch on the backend's device, the very one the model read: on a
    GPU the other copy is on the CPU and the loss's gather beside CUDA logits fails (found by
    the first run of benchmarks/gpu_check.py on an H100; this CPU cannot tell the devices apart,
    so the test checks that the two are one batch)."""
    import training.backend.rank_ops as rank_ops
    from training.data.packing import sft_loss

    read_by_model: list = []
    real_forward_logits = rank_ops.forward_logits

    def recording_forward_logits(model, batch):
        read_by_model.append(batch)
        return real_forward_logits(model, batch)

    def checking_loss(logits, batch, **kw):
        assert batch is read_by_model[-1], "the loss got another copy of the batch than the model"
        return sft_loss(logits, batch, **kw)

    monkeypatch.setattr(rank_ops, "forward_logits", recording_forward_logits)
    with make_backend(tiny_model_dir, tmp_path, loss_fn=checking_loss,
                      micro_batch_tokens=64) as backend:  # fmt: skip
        trained = await backend.forward_backward(samples[:16]).result()
        evaluated = await backend.forward(samples[16:32]).result()
    assert trained["n_microbatches"] > 1 and trained["loss"] > 0 and evaluated["loss"] > 0
    assert len(read_by_model) >= 2 * trained["n_microbatches"]
