"""The local engine's model-thread code makes every tensor on the engine's device.

Why: on CPU a tensor made without `device=` lands where the model is, so a missing device is
invisible to every CPU test; on a GPU it meets CUDA weights, logits or KV and the step fails
(`Expected all tensors to be on the same device`), and the project's GPU evidence comes from
rare, short sessions. So the property is checked where it can be on CPU: every tensor factory
called from engines/local/ while the runner prefills, decodes, samples (penalties, logit bias,
top-k/p/min-p, per-request seeds, logprobs and top logprobs, input logprobs), reuses the prefix
cache and releases / resumes its memory names its device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from engines.local.memory_occupation import MemoryOccupation
from engines.local.params import GenerateItem
from engines.local.runner import ModelRunner
from engines.local.sampling_params import SamplingParams
from engines.local.sequence import Sequence

ENGINE = str(Path(__file__).resolve().parent.parent / "engines" / "local")
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
             torch.arange, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye}  # fmt: skip


class DevicelessFactories(TorchFunctionMode):
    """Records (file:line, factory) of each tensor factory the engine calls without `device=`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(ENGINE):
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                self.calls.add(f"{where} {func.__name__}")
        return func(*args, **kwargs)


def request(rid: str, ids: list[int], *, logprobs: bool = False, top: int = 0, start: int = 0,
            **params) -> Sequence:  # fmt: skip
    sampling = SamplingParams(max_new_tokens=4, **params)
    return Sequence(GenerateItem(rid, ids, sampling, logprobs, start, top, False))


def test_the_engines_step_sampling_and_memory_release_make_every_tensor_on_its_device(
    tiny_model_dir,
):
    runner = ModelRunner(str(tiny_model_dir), max_prefix_cache_tokens=10_000)
    seqs = [
        request(
            "filtered",
            [3, 4, 5, 6],
            logprobs=True,
            top=3,
            top_k=5,
            top_p=0.9,
            min_p=0.05,
            sampling_seed=7,
        ),
        request(
            "penalised",
            [3, 4, 5, 6],
            repetition_penalty=1.2,
            frequency_penalty=0.1,
            presence_penalty=0.1,
            logit_bias=((5, 1.0),),
            min_new_tokens=3,
        ),
        request("greedy", [7, 8, 9], top_k=1),
    ]
    mode = DevicelessFactories()
    with mode:
        admit = seqs
        for _ in range(4):
            out = runner.step([s for s in seqs if s.finish_reason is None], admit)
            admit = []
            assert not out.errors, out.errors
            for seq, token, logprob, top in out.tokens:
                seq.append(token, logprob, top, "v0")
                if len(seq.output_ids) == 4:
                    seq.finish_reason = {"type": "length"}
        runner.step([], [])  # the finished rows leave: their KV goes to the prefix cache
        hit = request("cached", [3, 4, 5, 6, 10], logprobs=True, top=2, start=1)
        out = runner.step([], [hit])
        assert out.prefilled[0].cached_tokens > 0 and not out.errors
        memory = MemoryOccupation(runner)
        memory.release(["weights", "kv_cache"])
        memory.resume(["weights", "kv_cache"])
    assert seqs[0].runner_state.device == runner.device  # the request's own generator
    assert not mode.calls, f"tensors made without the engine's device: {sorted(mode.calls)}"
