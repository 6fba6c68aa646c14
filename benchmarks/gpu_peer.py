"""The GPU check's peer row (issue 43: "our tokens/s over theirs ≥ 1.3×"): a plain PyTorch SFT
loop written the way a strong peer would write it, with no project code in its training step,
on the same model directory, the same batches and the same GPU as the project's rows.

What the peer does (`peer_row`; benchmarks/gpu_check.py calls it):
- the same HF model directory, `AutoModelForCausalLM.from_pretrained(attn_implementation="sdpa")`,
  fp32 master weights, bf16 compute under `torch.autocast` (the project's rows compute bf16 over
  fp32 masters: like for like);
- AdamW with the project's hyper-parameters (lr 1e-5, betas (0.9, 0.95), eps 1e-8, no weight
  decay; `fused=True` on CUDA), gradients clipped at norm 1.0 as the project clips them;
- `torch.compile` on CUDA, per decoder layer (torchtitan's way: one graph, compiled once and
  reused by all 24 layers, while transformers' mask building, which branches on data, stays
  eager), and on the per-chunk loss; eager on CPU (Inductor takes minutes there);
- a chunked linear cross-entropy over the final hidden states (what Liger's fused linear
  cross-entropy does, in plain torch): each chunk of `CHUNK_TOKENS` trained tokens computes its
  bf16 logits, its loss and its gradients (for the hidden states and the tied output weight)
  in the forward pass, so no [tokens × vocab] tensor outlives its chunk and backward recomputes
  nothing (3 matmuls per chunk; checkpointing each chunk would take 4);
- the same samples packed first-fit into rows of `plan.pack_length`, `position_ids` restarting
  at 0 for every sample, `attention_mask=None` and no cache. transformers (≥ 4.53) then finds the
  samples from the position ids and gives sdpa a block-diagonal causal mask, so no token attends
  across samples: the peer's loss equals the project's up to bf16 rounding. (`use_cache=False`
  matters: with a cache, which a plain `model(...)` call builds even in train mode, transformers
  skips that detection and the row is one causal sequence.) sdpa runs its
  masked (memory-efficient) kernel, not flash: what a torch-only peer gets without
  flash-attn's varlen kernel;
- the whole step as one micro-batch (all rows) when it fits; after an out-of-memory error, two.
  If compiling fails, it runs eager, and says so in its figures (`config`).

What it is not: TRL's SFTTrainer (its wheels with datasets, pyarrow and pandas come to ~57 MB,
more than the ~60 MB the device tool carries beside the check's own), nor flash-attn (no wheel
for the image's torch). Its batches are packed outside the timed step (a DataLoader's workers
would); the project packs inside its step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK_TOKENS = 4096  # at most, per loss chunk: [4096, 151,936] fp32 logits = 2.5 GB
IGNORE = -100


@dataclass(frozen=True)
class PeerBatch:
    """One step's packed rows on the host: input ids and position ids [R, T], and the flat
    indices (into R·T) of the trained positions with their next-token targets."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    trained_at: torch.Tensor
    targets: torch.Tensor


def pack_step(samples: list, row_len: int) -> PeerBatch:
    """First-fit packing of `samples` (TokenizedSample-like: `input_ids`, `loss_mask`) into rows
    of `row_len`; position ids restart per sample; pads (id 0) are never trained."""
    rows: list[list] = []
    for s in sorted(samples, key=len, reverse=True):
        row = next((r for r in rows if sum(map(len, r)) + len(s) <= row_len), None)
        if row is None:
            rows.append(row := [])
        row.append(s)
    width = max(sum(map(len, r)) for r in rows)
    ids, pos, at, tgt = [], [], [], []
    for r in rows:
        start = len(ids)
        for s in r:
            n, base = len(s), len(ids)
            ids += s.input_ids
            pos += range(n)
            for t in range(n - 1):  # token t predicts t+1 when t+1 is trained
                if s.loss_mask[t + 1]:
                    at.append(base + t)
                    tgt.append(s.input_ids[t + 1])
        used = len(ids) - start
        ids += [0] * (width - used)
        pos += range(pos[-1] + 1, pos[-1] + 1 + width - used)  # pads continue the last sample
    shape = (len(rows), width)
    return PeerBatch(torch.tensor(ids).view(shape), torch.tensor(pos).view(shape),
                     torch.tensor(at), torch.tensor(tgt))  # fmt: skip


def final_hidden(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor):
    """The last layer's normed hidden states [R, T, H] of packed rows: no attention mask and no
    cache, so transformers splits each row into its samples by the restarting position ids."""
    return model.model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                       use_cache=False).last_hidden_state  # fmt: skip


def _chunk_loss_and_grads(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, scale: float):
    """(sum of the chunk's token losses, d loss/d h, d loss/d w) of `scale` × the summed
    cross-entropy of bf16 logits h @ w.T (softmax in fp32) against targets `y`."""
    logits = (h @ w.T).float()
    lse = logits.logsumexp(-1)
    loss = (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
    g = torch.exp(logits - lse[:, None])
    g.scatter_add_(1, y[:, None], torch.full_like(lse[:, None], -1.0))
    g = (g * scale).to(h.dtype)
    return loss, g @ w, g.T @ h


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """`scale` × Σ cross-entropy(h @ w.T, y), chunk by chunk, gradients computed in forward."""

    @staticmethod
    def forward(ctx, h, weight, y, scale: float, chunk_fn: Callable):
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(torch.bfloat16)
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros_like(weight, dtype=torch.float32)
            loss = torch.zeros((), device=h.device, dtype=torch.float32)
            n = h.shape[0]
            size = -(-n // -(-n // CHUNK_TOKENS))  # equal chunks: one shape, one compile
            for s in range(0, n, size):
                part, gh, gw = chunk_fn(h[s : s + size].to(torch.bfloat16), w, y[s : s + size],
                                        scale)  # fmt: skip
                loss += part
                grad_h[s : s + size] = gh
                grad_w += gw
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None


@dataclass
class Peer:
    """The peer's model, optimizer and loss on one device."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    chunk_fn: Callable
    device: str

    def step(self, batch: PeerBatch, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `batch` in `splits` micro-batches; (loss, grad norm) as
        device tensors (the mean loss over the step's trained tokens, as the project's)."""
        weight = self.model.get_output_embeddings().weight
        scale = 1.0 / batch.targets.numel()
        rows = batch.input_ids.shape[0]
        per = -(-rows // splits)
        width = batch.input_ids.shape[1]
        total = torch.zeros((), device=self.device)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            keep = (batch.trained_at >= r0 * width) & (batch.trained_at < r1 * width)
            at = (batch.trained_at[keep] - r0 * width).to(self.device, non_blocking=True)
            y = batch.targets[keep].to(self.device, non_blocking=True)
            ids = batch.input_ids[r0:r1].to(self.device, non_blocking=True)
            pos = batch.position_ids[r0:r1].to(self.device, non_blocking=True)
            with torch.autocast(self.device, dtype=torch.bfloat16):
                hidden = final_hidden(self.model, ids, pos)
            h = hidden.flatten(0, 1).index_select(0, at)
            loss = ChunkedLinearCrossEntropy.apply(h, weight, y, scale, self.chunk_fn)
            loss.backward()
            total += loss.detach()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, norm


def build_peer(model_dir: Path, device: str, *, compiled: bool) -> Peer:
    """The peer on `device`, from the HF directory (fp32 weights, sdpa attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)  # fmt: skip
    model.train()
    chunk_fn = _chunk_loss_and_grads
    if compiled:
        for layer in model.model.layers:
            layer.compile()
        chunk_fn = torch.compile(_chunk_loss_and_grads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0, fused=device == "cuda")  # fmt: skip
    return Peer(model, optimizer, chunk_fn, device)


def peer_row(plan, model_dir: Path, batches: list, n_matmul: int, gc_, busy_share: Callable,
             time_left: Callable[[], float]) -> dict:  # fmt: skip
    """The peer's figures on `batches` (lists of samples: the check's SFT steps), like the
    variant rows': step s, tokens/s, model TFLOP/s, peak memory, GPU-busy share of one profiled
    step, loss and grad norm of the last measured step; `config` says how it ran. Tries compiled
    with one micro-batch, then (out of memory) two, or (a compile error) eager, while
    `time_left()` s allows another go; else a RuntimeError names each try's error."""
    packed = [pack_step(b, plan.pack_length) for b in batches]
    tries = [(plan.device == "cuda", 1)]
    notes: list[str] = []
    started = time.perf_counter()
    while tries:
        compiled, splits = tries.pop(0)
        how = f"{'per-layer torch.compile' if compiled else 'eager'}, {splits} micro-batch(es)"
        failure, oom = None, False
        try:
            figures = _measure(plan, model_dir, batches, packed, n_matmul, gc_, busy_share,
                               compiled=compiled, splits=splits)  # fmt: skip
        except Exception as exc:  # the traceback holds the model: free it after this block
            failure = f"{type(exc).__name__}: {str(exc)[:160]}"
            oom = isinstance(exc, torch.cuda.OutOfMemoryError)
        if failure is None:
            rows, width = packed[0].input_ids.shape
            figures["config"] = f"{how} of {rows // splits} rows x {width}" + (
                "; after: " + " | ".join(notes) if notes else "")  # fmt: skip
            return figures
        notes.append(f"{how}: {failure}")
        gc_.free_device_memory(plan)
        if time_left() < 1.5 * (time.perf_counter() - started):
            break
        if oom and splits < 2:
            tries.append((compiled, 2 * splits))
        elif compiled:
            tries.append((False, splits))
    raise RuntimeError(" | ".join(notes))


def _measure(plan, model_dir: Path, batches: list, packed: list[PeerBatch], n_matmul: int, gc_,
             busy_share: Callable, *, compiled: bool, splits: int) -> dict:  # fmt: skip
    gc_.free_device_memory(plan)
    gc_.reset_peak_memory(plan)
    torch.manual_seed(0)
    peer = build_peer(model_dir, plan.device, compiled=compiled)
    try:
        times, flops, tokens = [], [], []
        for samples, batch in zip(batches, packed, strict=True):
            t0 = time.perf_counter()
            loss, norm = peer.step(batch, splits)
            loss_value, norm_value = float(loss), float(norm)  # one host sync, as a logger's
            times.append(time.perf_counter() - t0)
            lengths = [len(s) for s in samples]
            tokens.append(sum(lengths))
            flops.append(gc_.model_flops(plan.shape, n_matmul, lengths))
        figures = gc_.phase_figures(plan, times, tokens, flops, loss=loss_value)
        figures["grad_norm"] = norm_value
        figures["micro_batches"] = splits
        figures["compiled"] = compiled
        t0 = time.perf_counter()
        with gc_.profiled(plan) as prof:
            loss, _ = peer.step(packed[-1], splits)
            float(loss)
        figures["gpu_busy"] = busy_share(prof, time.perf_counter() - t0)
        return figures
    finally:
        del peer
        if compiled:  # the project's +compile row compiles its own layers from a clean cache
            torch._dynamo.reset()
        gc_.free_device_memory(plan)


def peer_table(f: dict, peak: float | None) -> str:
    """The peer's row, in the variant table's columns."""
    import harness

    if "error" in f:
        text = f["error"] if f["error"].startswith("skipped") else "failed: " + f["error"]
        return harness.md_table(["peer", "step (s)", "tokens/s"], [["plain torch SFT", text, ""]])

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f} %"

    mfu = f["tflops"] * 1e12 / peak if peak else None
    return harness.md_table(
        ["peer", "step (s)", "tokens/s", "MFU (project)", "peak GiB", "GPU busy", "loss",
         "grad norm", "how it ran"],
        [["plain torch SFT", f["step_s"], f["tokens_per_s"], pct(mfu), f["peak_memory_gib"],
          pct(f["gpu_busy"]), f["loss"], f["grad_norm"], f["config"]]],
    )  # fmt: skip


def fastest_ours(figures: dict) -> tuple[str, float] | None:
    """(name, tokens/s) of the fastest SFT row the project measured: `sft`, `sft_fused` or a
    variant's SFT phase; None when none was measured."""
    rows = {"sft": figures.get("sft", {}), "sft_fused": figures.get("sft_fused", {})}
    for name, r in figures.get("variants", {}).items():
        rows[f"{name} (SFT)"] = r.get("sft", {})
    measured = {k: f["tokens_per_s"] for k, f in rows.items() if "tokens_per_s" in f}
    if not measured:
        return None
    best = max(measured, key=measured.__getitem__)
    return best, measured[best]


def ratio(figures: dict) -> tuple[float | None, str | None]:
    """(ours / peer tokens/s, the name of our row) with ours the fastest SFT row the project
    measured; (None, None) when the peer or all our rows are missing."""
    ours = fastest_ours(figures)
    peer = figures.get("peer", {})
    if ours is None or "tokens_per_s" not in peer:
        return None, None
    return ours[1] / peer["tokens_per_s"], ours[0]


def ratio_line(figures: dict) -> str:
    """The `ours / peer` sentence under the peer's table."""
    value, row = ratio(figures)
    if value is None:
        why = figures.get("peer", {}).get("error", "no SFT row of ours measured")
        return f"ours / peer tokens/s: not measured ({why[:200]})."
    ours = fastest_ours(figures)
    assert ours is not None
    return (f"**ours / peer tokens/s: {value:.2f}x** (ours: the fastest SFT row, `{row}`, "
            f"{ours[1]:,.0f} tokens/s; peer: {figures['peer']['tokens_per_s']:,.0f} tokens/s; "
            "issue 43 asks for >= 1.3x on a GPU).")  # fmt: skip
