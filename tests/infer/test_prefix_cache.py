"""Automatic prefix cache: prompts sharing a prefix prefill only their suffix and decode as without reuse —
K2 (MLA) and K3-style hybrids (KDA states kept at block boundaries); LRU eviction under a byte cap."""

from __future__ import annotations

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.infer import GenerationConfig, generate
from k2lab.infer.cache import KDAState, RowState
from k2lab.infer.generate import prefill
from k2lab.infer.prefix_cache import PrefixCache
from tests.conftest import KIMI_LINEAR_STYLE, randomize

# A differently split prefill changes only fp32 rounding: per operation a relative 2^-23; a few hundred
# accumulations deep that stays far below 1e3 ulps of the logits' scale.
TOLERANCE = 1e3 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", params=["k2-nano", "k3-nano"])
def model(request):
    overrides = KIMI_LINEAR_STYLE if request.param == "k3-nano" else {}
    return randomize(build_model(load_preset(request.param, **overrides)), seed=1).eval()


def prompts_sharing_a_prefix(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 100, (37,), generator=g).tolist()
    tails = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (3, 9, 14, 1)]
    return [system + tail for tail in tails] + [torch.randint(3, 100, (6,), generator=g).tolist()]


def test_warm_cache_prefills_less_and_decodes_the_same(model):
    prompts = prompts_sharing_a_prefix()
    config = GenerationConfig(max_new_tokens=4)
    reference = generate(model, prompts, config)
    cache = PrefixCache.for_model(model, capacity_bytes=1 << 24, block_size=8)
    assert generate(model, prompts[:1], config, prefix_cache=cache) == reference[:1]  # cold: fills it
    hits = cache.hit_tokens
    assert generate(model, prompts, config, prefix_cache=cache) == reference  # warm
    assert cache.hit_tokens - hits >= 3 * 32  # rows 1-3 reuse at least the system prompt's 4 full blocks
    assert cache.stats()["hits"] > 0 and cache.stats()["misses"] > 0


def test_rows_of_one_batch_share_their_prefix(model):
    prompts = prompts_sharing_a_prefix(seed=3)
    prompts = prompts[:3] + prompts[1:3]  # two exact repeats (an RL group's samples)
    config = GenerationConfig(max_new_tokens=3)
    reference = generate(model, prompts, config)
    cache = PrefixCache.for_model(model, capacity_bytes=1 << 24, block_size=8)
    assert generate(model, prompts, config, prefix_cache=cache) == reference  # cold
    assert cache.hit_tokens >= 4 * 32  # the system prompt ran once, the repeats' prompts once each


def test_prefill_logits_match_within_fp32_rounding(model):
    prompts = prompts_sharing_a_prefix(seed=1)
    _, expected = prefill(model, prompts, room=1)
    cache = PrefixCache.for_model(model, capacity_bytes=1 << 24, block_size=8)
    prefill(model, prompts[:2], room=1, prefix_cache=cache)
    latents, logits = prefill(model, prompts, room=1, prefix_cache=cache)
    assert cache.hit_tokens > 0
    scale = expected.abs().max()
    assert (logits - expected).abs().max() <= TOLERANCE * scale
    assert latents.next_position.tolist() == [len(p) for p in prompts]


def test_seeded_sampling_is_unchanged_by_reuse(model):
    prompts = prompts_sharing_a_prefix(seed=2)
    config = GenerationConfig(max_new_tokens=4, temperature=1.0)
    seeds = [3, 1, 4, 1, 5]
    reference = generate(model, prompts, config, row_seeds=seeds)
    cache = PrefixCache.for_model(model, capacity_bytes=1 << 24, block_size=8)
    prefill(model, prompts[1:3], room=1, prefix_cache=cache)
    assert generate(model, prompts, config, row_seeds=seeds, prefix_cache=cache) == reference


def test_a_block_is_named_by_its_whole_prefix():
    cache = PrefixCache(capacity_bytes=1 << 20, block_size=2)
    cache.insert([1, 2, 3, 4], RowState(torch.ones(1, 4, 3), {}))
    assert cache.match([1, 2, 3, 4, 5]).length == 4
    assert cache.match([9, 9, 3, 4, 5]) is None  # block [3, 4] after another first block
    assert cache.match([1, 2, 3, 4]).length == 2  # the last token is always recomputed


def test_lru_evicts_leaves_first_under_the_byte_cap():
    block = torch.ones(1, 2, 4)  # 32 bytes a block
    cache = PrefixCache(capacity_bytes=4 * block.nbytes, block_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], RowState(torch.ones(1, 6, 4), {}))  # shared root [1, 2]
    cache.insert([1, 2, 7, 8], RowState(torch.ones(1, 4, 4), {}))
    assert len(cache) == 4 and cache.evictions == 0
    cache.match([1, 2, 7, 8, 0])  # the [7, 8] branch is now the most recent
    cache.insert([9, 9], RowState(torch.ones(1, 2, 4), {}))
    assert cache.evictions == 1 and cache.bytes <= cache.capacity_bytes
    assert cache.match([1, 2, 3, 4, 5, 6, 0]).length == 4  # the old branch lost its leaf [5, 6]
    assert cache.match([1, 2, 7, 8, 0]).length == 4


def test_changed_weights_empty_the_cache(nano):
    prompts = prompts_sharing_a_prefix()
    cache = PrefixCache.for_model(nano, capacity_bytes=1 << 24, block_size=8)
    prefill(nano, prompts, room=1, prefix_cache=cache)
    assert len(cache) > 0
    cache.check(nano)
    assert len(cache) > 0
    with torch.no_grad():
        nano.lm_head.weight.mul_(1.0)  # an in-place update, as an optimizer step makes
    cache.check(nano)
    assert len(cache) == 0


def test_hybrid_prefix_ends_at_a_block_with_kda_states_and_only_its_blocks_are_hits():
    """Blocks found without KDA states after them are recomputed, yet they counted as hits (k3-nano's
    /health said 701 hits with 0 hit tokens): hits and misses are blocks reused and recomputed."""
    cache = PrefixCache(capacity_bytes=1 << 20, block_size=2, needs_kda=True)
    cache.insert([1, 2, 3, 4], RowState(torch.ones(1, 4, 3), {}))  # rows only: not resumable
    assert cache.match([1, 2, 3, 4, 5]) is None
    assert (cache.hits, cache.misses, cache.hit_tokens) == (0, 2, 0)
    cache.insert([1, 2], RowState(torch.ones(1, 2, 3), {0: KDAState(torch.ones(1), torch.ones(1))}))
    assert cache.match([1, 2, 3, 4, 5]).length == 2  # resumed at [1, 2], [3, 4] recomputed
    assert (cache.hits, cache.misses, cache.hit_tokens) == (1, 3, 2)


def test_a_block_met_after_another_prefix_is_not_reused():
    """Block names chain (h_i = H(h_{i-1}, block i)): [7, 8] stored after [5, 6] is not the block [7, 8]
    after [1, 2], whose key rows attended to other tokens; the match stops at [1, 2], its own rows."""
    cache = PrefixCache(capacity_bytes=1 << 20, block_size=2)
    cache.insert([1, 2, 3, 4], RowState(torch.arange(1.0, 5.0).reshape(1, 4, 1), {}))
    cache.insert([5, 6, 7, 8], RowState(torch.arange(5.0, 9.0).reshape(1, 4, 1), {}))
    found = cache.match([1, 2, 7, 8, 9])
    assert found.length == 2
    assert found.rows.flatten().tolist() == [1.0, 2.0]
    assert cache.match([5, 6, 7, 8, 9]).rows.flatten().tolist() == [5.0, 6.0, 7.0, 8.0]


def test_kda_states_after_a_partial_block_are_not_kept():
    """The KDA states of a prefix that ends inside a block summarise tokens past its last full block: that
    block must not carry them (a hybrid model would resume at [1, 2] with the state after [1, 2, 3])."""
    cache = PrefixCache(capacity_bytes=1 << 20, block_size=2, needs_kda=True)
    state = {0: KDAState(torch.ones(1), torch.ones(1))}
    cache.insert([1, 2, 3], RowState(torch.ones(1, 3, 3), state))
    assert len(cache) == 1
    assert cache.match([1, 2, 3, 4]) is None
    cache.insert([1, 2], RowState(torch.ones(1, 2, 3), state))  # ends at the block: kept
    assert cache.match([1, 2, 3, 4]).length == 2
