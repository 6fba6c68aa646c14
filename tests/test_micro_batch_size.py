"""`backend.micro_batch_tokens: auto` (training/backend/micro_batch_size.py): the activation
estimate bounds what autograd really saves, the choice fits the memory it is given and grows
with it, and on CPU `auto` is exactly today's 8,192-token budget."""

from __future__ import annotations

import json
import random
import re
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from training.backend import micro_batch_size as mbs
from training.backend.pytorch import PyTorchTrainingBackend, load_model, load_tokenizer
from training.config import OptimConfig
from training.data.logprob_head import DEFAULT_CHUNK_TOKENS, forward_scores
from training.data.packing import prepare_sft_batch, sft_loss
from training.data.tokenize import TokenizedSample

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from launch_counts import NARROW

PACK = 256


@pytest.fixture(scope="module")
def narrow_model_dir(tmp_path_factory) -> Path:
    """The GPU check's 24-layer Qwen2 structure (14 heads, 2 KV heads) at narrow widths."""
    from gpu_check import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("narrow") / "model", dict(NARROW))


def packed_batch(pad_id: int, slots: int):
    rng = random.Random(0)
    samples = [TokenizedSample(tuple(rng.randrange(5, 300) for _ in range(64)),
                               (0,) * 8 + (1,) * 56, "m") for _ in range(slots // 64)]  # fmt: skip
    batch = prepare_sft_batch(samples, pad_id=pad_id, packing=True, max_tokens_per_row=PACK)
    assert batch.n_slots == slots
    return batch


def saved_bytes(model, batch) -> tuple[int, dict[int, int], int]:
    """(bytes of the unique non-parameter storages autograd saved during one forward + loss,
    those saved inside each decoder layer, by layer, bytes of the layers' inputs not among
    them) — the layers' inputs are what a checkpointed layer keeps outside autograd."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    by_layer: dict[int, int] = {}
    inputs: dict[int, int] = {}
    where: list[int | None] = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in seen:
            seen[s.data_ptr()] = s.nbytes()
            if where[0] is not None:
                by_layer[where[0]] = by_layer.get(where[0], 0) + s.nbytes()
        return t

    def enter(k, _module, args, kwargs):
        where[0] = k
        h = args[0] if args else kwargs["hidden_states"]
        inputs[h.untyped_storage().data_ptr()] = h.untyped_storage().nbytes()

    def leave(*_):
        where[0] = None

    layers = model.model.layers
    hooks = [h for k, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(partial(enter, k), with_kwargs=True),
        layer.register_forward_hook(leave))]  # fmt: skip
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = sft_loss(forward_scores(model, batch, chunk_tokens=DEFAULT_CHUNK_TOKENS),
                               batch)  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    del loss  # and the graph: nothing runs backward
    held = sum(n for ptr, n in inputs.items() if ptr not in seen)
    return sum(seen.values()), by_layer, held


@pytest.mark.parametrize("which", ["tiny", "narrow24"])
def test_activation_estimate_bounds_the_saved_tensors_within_2x(which, tiny_model_dir,
                                                                narrow_model_dir):  # fmt: skip
    """Per slot, the estimate is at least what autograd saves in a forward (with checkpointing:
    what it saves, the layers' inputs the checkpoints hold, and one layer recomputed in
    backward) and at most twice it, at two micro-batch sizes, with and without activation
    checkpointing; the tiny model in fp32, the 24-layer one in bf16."""
    model_dir, dtype, c = ((tiny_model_dir, "float32", 4) if which == "tiny"
                           else (narrow_model_dir, "bfloat16", 2))  # fmt: skip
    torch.manual_seed(0)
    model = load_model(str(model_dir), dtype=dtype)
    model.train()
    pad_id = load_tokenizer(model_dir).pad_token_id
    shape = mbs.ModelShape.of_config(model.config)
    ratios = []
    for slots in (512, 1536):
        batch = packed_batch(pad_id, slots)
        total, by_layer, _ = saved_bytes(model, batch)
        assert len(by_layer) == shape.layers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        outside, _, held = saved_bytes(model, batch)
        model.gradient_checkpointing_disable()
        assert outside + held < total / 2  # checkpointing did keep less
        for checkpointing, real in (
            (False, total),
            (True, outside + held + max(by_layer.values())),
        ):
            setup = mbs.Setup(compute_bytes=c, attention="masked", row_tokens=PACK,
                              checkpointing=checkpointing)  # fmt: skip
            ratios.append(mbs.activation_bytes_per_token(shape, setup) / (real / slots))
    assert all(1.0 <= r <= 2.0 for r in ratios), ratios


def test_the_chosen_micro_batch_fits_the_free_memory_with_margin_and_grows_with_it():
    per_token, fixed = 700_000.0, 9e9
    last = 0
    for free_gib in range(12, 160, 3):
        free = free_gib * 2**30
        for multiple in (PACK, 2048, mbs.UNPACKED_GRANULE):
            n = mbs.choose_micro_batch_tokens(free, per_token=per_token, fixed_bytes=fixed,
                                              multiple_of=multiple)  # fmt: skip
            assert n % multiple == 0 and multiple <= n <= mbs.CAP_TOKENS
            if n > multiple:  # more than the least that can run: it fits, with the margin
                assert fixed + n * per_token <= (1 - mbs.MARGIN) * free
        n = mbs.choose_micro_batch_tokens(free, per_token=per_token, fixed_bytes=fixed,
                                          multiple_of=PACK)  # fmt: skip
        assert n >= last
        last = n
    assert last == mbs.CAP_TOKENS  # 159 GiB holds the cap


@pytest.mark.parametrize(("attention", "per_token_kib", "chosen_h100", "chosen_h200"),
                         [("masked", 1584, 28_672, 57_344), ("varlen", 1409, 30_720, 65_536)])  # fmt: skip
def test_the_gpu_checks_shape_gets_what_docs_gpus_md_says(attention, per_token_kib, chosen_h100,
                                                         chosen_h200):  # fmt: skip
    """Qwen2.5-0.5B (24 layers), bf16 compute over fp32 masters, FSDP2 in a group of one with
    accumulate_unsharded, AdamW, packed rows of 2,048, sdpa (masked) or segments (varlen), with
    75 GiB free after the model is built (an H100 80GB) or 135 GiB (an H200): docs/gpus.md."""
    from gpu_check import QWEN_05B

    config = type("Config", (), dict(QWEN_05B))()
    shape = mbs.ModelShape.of_config(config)
    setup = mbs.Setup(compute_bytes=2, attention=attention, row_tokens=2048)
    per_token = mbs.activation_bytes_per_token(shape, setup)
    n = 494_032_768  # parameters (tied embedding once)
    state = mbs.TrainingState(params=n, trainable=n, param_bytes=4, gathered_params=n,
                              gathered_grads=n, compute_bytes=2)  # fmt: skip
    fixed = mbs.pending_bytes(state) + mbs.head_chunk_bytes(shape, setup)
    assert round(per_token / 1024) == per_token_kib
    assert round(fixed / 2**30, 1) == 12.9  # 1.8 grads + 3.7 AdamW + 2.8 gathered + 4.6 head
    chosen = [mbs.choose_micro_batch_tokens(free * 2**30, per_token=per_token, fixed_bytes=fixed,
                                            multiple_of=2048) for free in (75, 135)]  # fmt: skip
    assert chosen == [chosen_h100, chosen_h200]


async def test_auto_on_cpu_splits_and_trains_exactly_as_8192(tiny_model_dir, tmp_path, monkeypatch):
    """`auto` on CPU is today's fixed 8,192-token budget: the same micro-batches (packed rows
    and one row per sample, of a ~27k-token batch), and the same loss and gradient norm, bit
    for bit, of a step of two micro-batches."""
    from training.backend.micro_batch_auto import FREE_MEMORY_ENV

    monkeypatch.delenv(FREE_MEMORY_ENV, raising=False)
    tok = load_tokenizer(tiny_model_dir)
    rng = random.Random(3)
    samples = [TokenizedSample(tuple(rng.randrange(5, 300) for _ in range(n)),
                               (0,) * 8 + (1,) * (n - 8), "m")
               for n in (rng.randrange(40, 500) for _ in range(100))]  # fmt: skip
    step_batch = samples[:36]  # ~9.5k tokens: two micro-batches of 8,192
    results = []
    for setting in ("auto", 8192):
        splits = []
        for pack_length in (512, None):
            torch.manual_seed(0)
            with PyTorchTrainingBackend(
                partial(load_model, str(tiny_model_dir)), tok, optim=OptimConfig(lr=1e-3),
                max_steps=2, checkpoint_dir=tmp_path / f"{setting}-{pack_length}",
                micro_batch_tokens=setting, pack_length=pack_length,
            ) as backend:  # fmt: skip
                assert backend.micro_batch_tokens == 8192
                splits.append([[id(s) for s in mb] for mb in backend.split_microbatches(samples)])
                if pack_length is not None:
                    fb = await backend.forward_backward(step_batch).result()
                    step = await backend.optim_step().result()
        results.append((splits, fb["n_microbatches"], fb["loss"], step["grad_norm"]))
    assert results[0] == results[1]
    assert all(len(split) >= 3 for split in results[0][0]) and results[0][1] == 2


def test_auto_in_yaml_and_on_the_command_line_round_trips(tmp_path):
    from training.config import SFTRunConfig, config_to_yaml, load_config
    from training.rl_config import RLRunConfig

    path = tmp_path / "run.yaml"
    path.write_text("backend:\n  micro_batch_tokens: auto\n")
    assert load_config(SFTRunConfig, path).backend.micro_batch_tokens == "auto"
    assert SFTRunConfig().backend.micro_batch_tokens == "auto"  # the default
    assert RLRunConfig().backend.micro_batch_tokens == "auto"
    over = load_config(SFTRunConfig, path, ["backend.micro_batch_tokens=4096"])
    assert over.backend.micro_batch_tokens == 4096  # an int keeps meaning that int
    back = load_config(SFTRunConfig, path, ["backend.micro_batch_tokens=auto"])
    saved = tmp_path / "saved.yaml"
    saved.write_text(config_to_yaml(back))  # as logged and saved with checkpoints
    assert load_config(SFTRunConfig, saved) == back


@pytest.mark.parametrize("bad", ["4", "big", "8.5", "true", "Auto"])
def test_a_bad_micro_batch_budget_names_the_key(bad):
    from plumbing.errors import ConfigError
    from training.config import SFTRunConfig, load_config

    with pytest.raises(ConfigError, match=r"backend\.micro_batch_tokens: .*`auto` or a token "
                                          r"count ≥ 8"):  # fmt: skip
        load_config(SFTRunConfig, None, [f"backend.micro_batch_tokens={bad}"])


def test_ranks_given_different_free_memory_all_take_the_smallest_choice(
    tiny_model_dir, tmp_path, warm_python
):
    """Under torchrun each rank chooses from its own free memory and every rank takes the
    least choice (one all-reduce MIN), so they split alike: two gloo ranks, 1.5 and 0.5 GB."""
    from tests.distributed_launch import launch

    proc = launch("tests/micro_batch_ranks.py", str(tiny_model_dir), str(tmp_path),
                  "1.5e9", "0.5e9", world=2, cwd=tmp_path, timeout=240, warm=warm_python)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.log").read_text().splitlines() for r in (0, 1)]
    assert [len(x) for x in lines] == [1, 1], lines
    found = [re.search(r"auto: ([\d,]+) tokens .* \(this rank's: ([\d,]+)\)", x[0]) for x in lines]
    taken = tuple(int(m[1].replace(",", "")) for m in found)
    own = tuple(int(m[2].replace(",", "")) for m in found)
    assert own[0] > own[1]  # different memory, different choices (neither at the cap)
    assert taken == (own[1], own[1])
    assert json.loads((tmp_path / "rank0.json").read_text())["micro_batch_tokens"] == own[1]
