"""`backend.fsdp.compile_layers` (training/distributed/context.py `compile_layers`): each decoder
layer compiled with Inductor computes what the eager layer does — the tiny model's SFT loss and
every gradient, on packed rows, under sdpa and the segment attention. Inductor's CPU compile of
even the tiny model took ~3 minutes for both cases on the shared 2-core machine, so this is a
`stress` test."""

from __future__ import annotations

import copy

import pytest

from training.data.packing import forward_logits, prepare_sft_batch, sft_loss
from training.distributed.context import compile_layers, decoder_layers

pytestmark = pytest.mark.stress


@pytest.mark.parametrize("attention", ["sdpa", "segments"])
def test_compiled_layers_give_the_eager_loss_and_gradients(tiny_model_dir, attention):
    from tests.test_segment_attention import packed_samples
    from training.backend.model_io import load_model

    eager = load_model(tiny_model_dir, attention=attention)
    compiled = copy.deepcopy(eager)
    compile_layers(decoder_layers(compiled))
    batch = prepare_sft_batch(packed_samples(), pad_id=0, max_tokens_per_row=96)
    out = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        loss, _ = sft_loss(forward_logits(model, batch), batch)
        loss.backward()
        out[name] = loss.item(), {k: p.grad for k, p in model.named_parameters()}
    (loss, grads), (loss0, grads0) = out["compiled"], out["eager"]
    assert abs(loss - loss0) <= 1e-5 * abs(loss0)
    for k, g0 in grads0.items():
        err = ((grads[k] - g0).abs().max() / g0.abs().max().clamp_min(1e-12)).item()
        assert err < 1e-4, (k, err)
