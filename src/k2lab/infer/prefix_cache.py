"""Automatic prefix cache: token blocks hashed by chaining, their cache rows stored once and shared.

A prompt is cut into blocks of ``block_size`` tokens. Block i is named by a chained hash

    h_0 = H(∅, t_0 … t_{b−1}),    h_i = H(h_{i−1}, t_{ib} … t_{(i+1)b−1})

so equal names mean equal token prefixes (vLLM's automatic prefix caching names its KV blocks the same
way). Each stored block holds its tokens' MLA latent rows [L_mla, b, C + r]: a key row depends only on
the tokens before it and its position, both fixed by the name, so any request with that prefix can
attend to it. KDA layers (Kimi Linear, K3) summarise the whole prefix in a recurrent state instead, so a
block can also carry the KDA states after its last token (``RowState.kda``); on a hybrid model a prefix
can only be resumed at a block that has them (generation stores them at the last full block of each
prompt).

``match(ids)`` returns the longest cached prefix as a ``RowState`` (at most ``len(ids) − 1`` tokens:
the last prompt token is always run, its logits start decoding); the caller prefills only the rest and
``insert``s what it computed. Blocks are evicted least recently used first under ``capacity_bytes``; a
match touches its blocks from the last to the first, so a block is always more recent than its children
and eviction takes leaves first. The cache belongs to one model: ``check(model)`` empties it when the
weights change (a parameter's in-place version counter moved, e.g. after an optimizer step), so cached
rows never come from older weights.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k2lab.infer.cache import KDAState, RowState

__all__ = ["PrefixCache", "weights_version"]


@dataclass
class _Block:
    parent: bytes | None
    rows: torch.Tensor  # [L_mla, block_size, C + r]
    kda: dict[int, KDAState] | None = None  # the KDA states after the block's last token
    children: int = 0

    def nbytes(self) -> int:
        kda = sum(state.nbytes() for state in self.kda.values()) if self.kda else 0
        return self.rows.nbytes + kda


def weights_version(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """(storage address, in-place version) of every parameter and buffer: changes when any is updated."""
    tensors = [*model.parameters(), *model.buffers()]
    return tuple((t.data_ptr(), t._version) for t in tensors)


class PrefixCache:
    """Blocks of ``block_size`` tokens keyed by chained hash, LRU under ``capacity_bytes``.

    ``needs_kda``: the model has KDA layers, so a prefix ends only at a block carrying KDA states.
    Counters: ``hits`` / ``misses`` (blocks looked up and reused or recomputed: on a hybrid model a block
    found past the prefix's last KDA states is a miss), ``hit_tokens`` (prompt tokens not recomputed),
    ``query_tokens`` (prompt tokens looked up), ``evictions`` (blocks), ``bytes``.
    """

    def __init__(self, capacity_bytes: int, block_size: int = 16, needs_kda: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be non-negative, got {capacity_bytes}")
        self.capacity_bytes, self.block_size, self.needs_kda = capacity_bytes, block_size, needs_kda
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._version: tuple | None = None
        self.hits = self.misses = self.evictions = self.bytes = 0
        self.hit_tokens = self.query_tokens = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, capacity_bytes: int, block_size: int = 16) -> PrefixCache:
        """A cache sized for ``model`` (a ``CausalLM`` or a VLM): KDA states kept when it has KDA layers."""
        config = getattr(model, "language_model", model).config
        return cls(capacity_bytes, block_size, needs_kda="kda" in config.layer_types)

    # ---- naming --------------------------------------------------------------------------------------
    def _names(self, ids: Sequence[int], blocks: int) -> list[bytes]:
        """The chained hashes of the first ``blocks`` full blocks of ``ids``."""
        names, parent, b = [], b"", self.block_size
        for i in range(blocks):
            tokens = struct.pack(f"<{b}q", *ids[i * b : (i + 1) * b])
            parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
            names.append(parent)
        return names

    # ---- lookup --------------------------------------------------------------------------------------
    def check(self, model: torch.nn.Module) -> None:
        """Empty the cache if ``model``'s weights changed since the last check."""
        version = weights_version(model)
        if version != self._version:
            self.clear()
            self._version = version

    def match(self, ids: Sequence[int]) -> RowState | None:
        """The longest cached prefix of ``ids`` (block-aligned, at most ``len(ids) − 1`` tokens; on a hybrid
        model ending at a block with KDA states), or None. Counts hits and misses, refreshes the blocks."""
        usable = (len(ids) - 1) // self.block_size
        chain: list[_Block] = []
        for name in self._names(ids, usable):
            block = self._blocks.get(name)
            if block is None:
                break
            chain.append(block)
        if self.needs_kda:
            while chain and chain[-1].kda is None:
                chain.pop()
        self.hits += len(chain)  # reused; a block found past the last KDA states is recomputed: a miss
        self.misses += usable - len(chain)
        self.query_tokens += len(ids)
        if not chain:
            return None
        self._touch(self._names(ids, len(chain)))
        self.hit_tokens += len(chain) * self.block_size
        rows = torch.cat([block.rows for block in chain], dim=1)
        return RowState(rows, dict(chain[-1].kda or {}))

    def shared_prefixes(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Prefixes that two or more of ``prompts`` share and the cache cannot resume yet, each as its full
        blocks plus the next token (so a prefill of it stores every block, KDA states included): prefilling
        these first lets prompts of one batch reuse each other's blocks."""
        b = self.block_size
        chains = [self._names(p, (len(p) - 1) // b) for p in prompts]
        count = Counter(name for names in chains for name in names)
        shared: dict[bytes, list[int]] = {}
        for prompt, names in zip(prompts, chains, strict=True):
            deepest = max((i for i, name in enumerate(names) if count[name] > 1), default=None)
            if deepest is None or self._resumable(names[deepest]):
                continue
            shared.setdefault(names[deepest], list(prompt[: (deepest + 1) * b + 1]))
        return list(shared.values())

    def _resumable(self, name: bytes) -> bool:
        block = self._blocks.get(name)
        return block is not None and (block.kda is not None or not self.needs_kda)

    def _touch(self, names: list[bytes]) -> None:
        for name in reversed(names):  # the first block ends most recent: leaves are evicted first
            self._blocks.move_to_end(name)

    # ---- storing -------------------------------------------------------------------------------------
    def insert(self, ids: Sequence[int], state: RowState) -> None:
        """Store the full blocks of ``ids[:state.length]`` (``state``: their rows, computed by the model);
        its KDA states go on the last block when ``state.length`` ends one. Blocks already cached are kept."""
        b = self.block_size
        count = state.length // b
        names = self._names(ids, count)
        parent: bytes | None = None
        for i, name in enumerate(names):
            block = self._blocks.get(name)
            if block is None:
                block = _Block(parent, state.rows[:, i * b : (i + 1) * b].clone())
                self._blocks[name] = block
                self.bytes += block.nbytes()
                if parent is not None:
                    self._blocks[parent].children += 1
            parent = name
        if names and state.kda and state.length == count * b and self._blocks[names[-1]].kda is None:
            last = self._blocks[names[-1]]
            last.kda = {k: KDAState(s.conv.clone(), s.recurrent.clone()) for k, s in state.kda.items()}
            self.bytes += sum(s.nbytes() for s in last.kda.values())
        self._touch(names)
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used leaves until the cache fits ``capacity_bytes``."""
        while self.bytes > self.capacity_bytes and self._blocks:
            name = next(name for name, block in self._blocks.items() if block.children == 0)
            block = self._blocks.pop(name)
            self.bytes -= block.nbytes()
            self.evictions += 1
            if block.parent is not None and block.parent in self._blocks:
                self._blocks[block.parent].children -= 1

    def clear(self) -> None:
        """Drop every block (the counters of hits and misses stay)."""
        self._blocks.clear()
        self.bytes = 0

    # ---- reporting -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict[str, int | float]:
        """Counters for a metrics endpoint: hits, misses, hit_rate (of looked-up tokens), evictions, bytes."""
        return {
            "blocks": len(self._blocks),
            "block_size": self.block_size,
            "hits": self.hits,
            "misses": self.misses,
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "evictions": self.evictions,
            "bytes": self.bytes,
            "capacity_bytes": self.capacity_bytes,
        }
