"""A token-level radix prefix cache for the local engine (SGLang's radix cache, in its memory).

What it holds: the KV (one (keys, values) pair per layer, `[kv_heads, tokens, head_dim]`) of
token sequences the engine prefilled or finished, in one radix tree per namespace, on the
engine's device and in its dtype (GPU memory under `--device cuda`, bounded by the budget
below). The namespace is `(generation, extra_key, adapter id)`, from `namespace()`: SGLang keys its tree by
`GenerateReqInput.extra_key` with the id of the request's LoRA load appended (`Req.__init__`:
`extra_key = (extra_key or "") + lora_id`, a fresh id per load), so requests of different
namespaces never share KV. The generation is the engine's own weight generation: the cache
keys itself by it instead of trusting the client's `extra_key` to change with the weights.

Contract:
- `match(ns, tokens, limit)` returns the longest cached prefix of `tokens` (at most `limit`
  tokens) and its KV, concatenated per layer (a copy: later evictions cannot touch it).
- `insert(ns, tokens, kv)` stores what is not cached yet; the tree splits edges as needed and
  stores clones, so a batch tensor is never kept alive by a view.
- The budget (`--max-prefix-cache-tokens`) bounds the tokens held; past it, least recently
  used leaves are evicted first (SGLang's LRU policy). Budget 0 disables the cache.
- `new_generation()` (every weight load, `/flush_cache`) drops everything and starts a new
  weight generation; `adapter_loaded(name)` / `adapter_deleted(name)` drop an adapter's trees
  and give each load of a name a fresh id. `insert` ignores a namespace that is no longer
  live (an older generation, an adapter load since replaced or deleted): KV computed before
  a weight or adapter change (a row still in the batch, written back when it leaves) is never
  cached after it, whatever the pause mode or the request's `extra_key`.

Single-threaded: only the model thread calls it (the runner owns it).
Not covered: paged memory, sharing KV storage between the tree and running rows (KV is
copied in and out), host/disk tiers.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Any

import torch

Namespace = tuple[int, str | None, str | None]  # (generation, extra_key, adapter load id)
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [kv_heads, tokens, head_dim]


class _Node:
    __slots__ = ("children", "kv", "last_used", "parent", "tokens")

    def __init__(self, parent: _Node | None, tokens: tuple[int, ...], kv: LayerKV) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.tokens = tokens
        self.kv = kv
        self.last_used = 0


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_prefix_cache_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.total_tokens = 0
        self._roots: dict[Hashable, _Node] = {}
        self._clock = itertools.count(1)
        self.generation = 0  # weight loads and flushes so far
        self._adapters: dict[str, str] = {}  # loaded adapter name -> id of its current load
        self._loads = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def clear(self) -> None:
        self._roots.clear()
        self.total_tokens = 0

    def new_generation(self) -> None:
        """The weights changed (or a flush): nothing cached so far is reused or cached again."""
        self.clear()
        self.generation += 1

    def adapter_loaded(self, name: str) -> None:
        """`name` now holds a new adapter load: a fresh id, the old load's trees dropped."""
        self.adapter_deleted(name)
        self._adapters[name] = f"{name}#{next(self._loads)}"

    def adapter_deleted(self, name: str) -> None:
        adapter = self._adapters.pop(name, None)
        for ns in [ns for ns in self._roots if adapter is not None and ns[2] == adapter]:
            self.total_tokens -= _count(self._roots.pop(ns))

    def namespace(self, extra_key: str | None, lora_name: str | None) -> Namespace:
        """The live namespace of a request with this `extra_key` and adapter (None: base)."""
        adapter = None if lora_name is None else self._adapters.get(lora_name, f"{lora_name}#-")
        return (self.generation, extra_key, adapter)

    def _live(self, ns: Namespace) -> bool:
        return ns[0] == self.generation and (ns[2] is None or ns[2] in self._adapters.values())

    def match(self, ns: Namespace, tokens: list[int], limit: int) -> tuple[int, LayerKV | None]:
        """(matched length, its KV per layer `[1, heads, length, dim]`), or (0, None)."""
        root = self._roots.get(ns)
        limit = min(limit, len(tokens))
        if root is None or limit <= 0:
            return 0, None
        now = next(self._clock)
        parts: list[tuple[_Node, int]] = []
        node, pos = root, 0
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(child.tokens, tokens, pos, limit)
            child.last_used = now
            parts.append((child, n))
            pos += n
            if n < len(child.tokens):
                break
            node = child
        if pos == 0:
            return 0, None
        layers = len(parts[0][0].kv)
        kv = [
            tuple(
                torch.cat([p.kv[layer][i][:, :n] for p, n in parts], dim=1).unsqueeze(0)
                for i in (0, 1)
            )
            for layer in range(layers)
        ]
        return pos, kv  # type: ignore[return-value]

    def insert(self, ns: Namespace, tokens: list[int], kv: LayerKV) -> None:
        """Cache `tokens` with their KV (`[heads, len(tokens), dim]` per layer), if `ns` is live."""
        if not self.enabled or not tokens or not self._live(ns):
            return
        now = next(self._clock)
        node = self._roots.setdefault(ns, _Node(None, (), []))
        pos = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                rest = tuple(tokens[pos:])
                leaf = _Node(node, rest, [(k[:, pos:].clone(), v[:, pos:].clone()) for k, v in kv])
                leaf.last_used = now
                node.children[rest[0]] = leaf
                self.total_tokens += len(rest)
                break
            n = _common(child.tokens, tokens, pos, len(tokens))
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_used = now
            node, pos = child, pos + n
        self._evict()

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(
            parent, child.tokens[:n], [(k[:, :n].clone(), v[:, :n].clone()) for k, v in child.kv]
        )
        upper.last_used = child.last_used
        parent.children[child.tokens[0]] = upper
        child.parent, child.tokens = upper, child.tokens[n:]
        child.kv = [(k[:, n:].clone(), v[:, n:].clone()) for k, v in child.kv]
        upper.children[child.tokens[0]] = child
        return upper

    def _evict(self) -> None:
        if self.total_tokens <= self.max_tokens:
            return
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.total_tokens > self.max_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self.total_tokens -= len(leaf.tokens)
            if parent.parent is not None and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        for ns in [ns for ns, root in self._roots.items() if not root.children]:
            del self._roots[ns]

    def _nodes(self) -> list[_Node]:
        out: list[_Node] = []
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def stats(self) -> dict[str, Any]:
        return {"tokens": self.total_tokens, "max_tokens": self.max_tokens,
                "namespaces": len(self._roots)}  # fmt: skip


def _common(edge: tuple[int, ...], tokens: list[int], pos: int, limit: int) -> int:
    n, most = 0, min(len(edge), limit - pos)
    while n < most and edge[n] == tokens[pos + n]:
        n += 1
    return n


def _count(root: _Node) -> int:
    total, stack = 0, list(root.children.values())
    while stack:
        node = stack.pop()
        total += len(node.tokens)
        stack.extend(node.children.values())
    return total


# ----- batch layout of a prefill that reuses cached prefixes (used by runner.py) --------------


def max_prefix_len(seq: Any, most: int | None = None) -> int:
    """SGLang's `Req._compute_max_prefix_len` for a `Sequence`: its prefill length - 1, and not
    past `logprob_start_len` while input logprobs are still to be computed."""
    limit = len(seq.prefill_ids) - 1 if most is None else most
    if seq.item.return_logprob and not seq.prefilled:
        limit = min(limit, seq.item.logprob_start_len)
    return max(limit, 0)


def prefill_layout(prompts: list[list[int]], hits: list[tuple[int, LayerKV | None]], pad_id: int,
                   device: torch.device) -> tuple[LayerKV, torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """(past KV `[rows, heads, past, dim]` per layer, mask `[rows, past + width]`, suffix ids
    `[rows, width]`, past): each row's cached prefix right-aligned in the past columns, its
    uncached suffix right-aligned in the new ones; zeros and mask 0 elsewhere. `hits[r]` is
    row r's `match()`. Past KV is empty (and `past` 0) when nothing matched."""
    past = max(m for m, _ in hits)
    width = max(len(p) - m for p, (m, _) in zip(prompts, hits, strict=True))
    rows = len(prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((rows, past + width), dtype=torch.long, device=device)
    for r, (p, (m, _)) in enumerate(zip(prompts, hits, strict=True)):
        suffix = p[m:]
        ids[r, width - len(suffix) :] = torch.tensor(suffix, device=device)
        mask[r, past - m : past] = 1
        mask[r, past + width - len(suffix) :] = 1
    kvs: LayerKV = []
    if past:
        shapes = next(kv for _, kv in hits if kv is not None)
        for layer, (k0, v0) in enumerate(shapes):
            k = k0.new_zeros((rows, k0.shape[1], past, k0.shape[3]))
            v = v0.new_zeros((rows, v0.shape[1], past, v0.shape[3]))
            for r, (m, kv) in enumerate(hits):
                if kv is not None:
                    k[r, :, past - m :], v[r, :, past - m :] = kv[layer][0][0], kv[layer][1][0]
            kvs.append((k, v))
    return kvs, mask, ids, past


def cache_prompts(cache: PrefixCache, namespaces: list[Namespace], prompts: list[list[int]],
                  hits: list[tuple[int, LayerKV | None]], kvs: LayerKV, past: int) -> None:  # fmt: skip
    """Insert each prefilled prompt's KV: row r's cached prefix (the last `m` past columns) and
    the suffix just computed (the last `len - m` columns), from the batch KV `kvs`."""
    if not cache.enabled:
        return
    for r, p in enumerate(prompts):
        m, n = hits[r][0], len(p) - hits[r][0]
        kv = [(torch.cat([k[r, :, past - m : past], k[r, :, k.shape[2] - n :]], dim=1),
               torch.cat([v[r, :, past - m : past], v[r, :, v.shape[2] - n :]], dim=1))
              for k, v in kvs]  # fmt: skip
        cache.insert(namespaces[r], p, kv)
