"""Prefix packs: every row's tokens are in its pack once per distinct prefix, the tree mask lets each token
see exactly the tokens before it in its row, and a packed forward gives each row its own logits."""

from __future__ import annotations

import random

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.posttrain.prefix_tree import batch_packs, prefix_packs, tree_mask
from tests.conftest import randomize


def _rows(seed: int = 0) -> list[list[int]]:
    """Three groups of rows that share long prompts (two groups share a shorter system part), branching at
    several depths, one duplicate row, one row that is a prefix of another, and two loners."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(20)]
    rows = []
    for _ in range(3):
        prompt = system + [rng.randrange(3, 300) for _ in range(rng.randrange(10, 30))]
        for _ in range(4):
            answer = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))]
            rows.append(prompt + answer)
            if rng.random() < 0.5:  # a second turn after a shared first answer
                rows.append(prompt + answer + [rng.randrange(3, 300) for _ in range(5)])
    rows.append(list(rows[0]))  # duplicate
    rows.append(rows[1][: len(system) + 3])  # a prefix of other rows
    rows += [[7, 8, 9], [rng.randrange(3, 300) for _ in range(40)]]
    return rows


def _distinct_prefixes(rows: list[list[int]]) -> int:
    return len({tuple(row[: i + 1]) for row in rows for i in range(len(row))})


def test_packs_hold_every_row_and_each_shared_token_once():
    rows = _rows()
    packs = prefix_packs(rows, min_shared=16)
    assert sorted(r for pack in packs for r in pack.rows) == list(range(len(rows)))
    for pack in packs:
        for row, path in zip(pack.rows, pack.paths, strict=True):
            assert [pack.ids[i] for i in path] == rows[row]
            assert [pack.positions[i] for i in path] == list(range(len(rows[row])))
    # shared rows form one pack (all 3 groups share the 20-token system part); loners stay apart
    assert sorted(len(pack.rows) for pack in packs) == [1, 1, len(rows) - 2]
    assert sum(map(len, packs)) == sum(_distinct_prefixes([rows[r] for r in p.rows]) for p in packs)
    assert sum(map(len, packs)) < sum(map(len, rows)) / 2
    assert [len(p) for p in packs] == sorted(len(p) for p in packs)  # shortest first
    alone = prefix_packs(rows, min_shared=None)
    assert sorted(p.rows for p in alone) == [[r] for r in range(len(rows))]
    assert [len(p) for p in alone] == sorted(map(len, rows))
    # above the shared length, rows are packed apart
    assert len(prefix_packs(rows, min_shared=21)) > len(packs)


def test_tree_mask_sees_exactly_the_earlier_tokens_of_the_row():
    rows = _rows(1)
    for pack in prefix_packs(rows, min_shared=16):
        allowed = pack.allowed()
        for path in pack.paths:
            for t, q in enumerate(path):
                seen = set(allowed[q].nonzero()[:, 0].tolist())
                assert seen == set(path[: t + 1])
    packs = prefix_packs(rows, min_shared=16)
    (ids, positions), mask = batch_packs(packs), tree_mask(packs)
    assert ids.shape == positions.shape == mask.shape[:2] and mask.shape[1] == mask.shape[2]
    assert mask.diagonal(dim1=1, dim2=2).all()  # padding queries see themselves


def test_packed_forward_gives_every_row_its_own_logits():
    model = randomize(build_model(load_preset("k2-nano", vocab_size=300))).eval()
    rows = _rows(2)
    packs = prefix_packs(rows, min_shared=16)
    (ids, positions), mask = batch_packs(packs), tree_mask(packs)
    with torch.no_grad():
        packed = model(ids, attention_mask=mask, position_ids=positions).logits
        for b, pack in enumerate(packs):
            for row, path in zip(pack.rows, pack.paths, strict=True):
                alone = model(torch.tensor([rows[row]])).logits[0]
                torch.testing.assert_close(packed[b, path], alone, rtol=1e-4, atol=1e-4)


def test_tree_masks_need_positions_and_an_mla_only_model():
    mask = torch.ones(1, 4, 4, dtype=torch.bool).tril()
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="position_ids"):
        build_model(load_preset("k2-nano", vocab_size=300))(ids, attention_mask=mask)
    kda = build_model(load_preset("k3-nano", vocab_size=300))
    with pytest.raises(ValueError, match="MLA-only"):
        kda(ids, attention_mask=mask, position_ids=torch.arange(4)[None])
