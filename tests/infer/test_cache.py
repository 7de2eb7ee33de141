"""Continuous batching on the decode cache: sequences prefilled apart and merged (``LatentCache.concat``),
or dropped mid-flight (``select``), decode exactly as they would alone — K2 (MLA) and K3-style (KDA)."""

from __future__ import annotations

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.infer.cache import LatentCache
from tests.conftest import KIMI_LINEAR_STYLE, randomize


@pytest.fixture(params=["k2-nano", "k3-nano"])
def model(request):
    overrides = KIMI_LINEAR_STYLE if request.param == "k3-nano" else {}
    return randomize(build_model(load_preset(request.param, **overrides)), seed=1)


def alone(model, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    """Logits of each decode step for ``prompt`` run by itself."""
    cache = LatentCache(model.config, 1, len(prompt) + len(steps))
    model(torch.tensor([prompt]), cache=cache)
    return [model(torch.tensor([[t]]), cache=cache).logits[0, -1] for t in steps]


@torch.no_grad()
def test_merged_and_dropped_sequences_decode_as_alone(model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 11, 8)]
    steps = [torch.randint(3, 100, (4,), generator=g).tolist() for _ in prompts]
    reference = [alone(model, p, s) for p, s in zip(prompts, steps, strict=True)]

    # sequence 0 starts first and decodes one step; then 1 and 2 are prefilled together and merged in
    first = LatentCache(model.config, 1, 32)
    model(torch.tensor([prompts[0]]), cache=first)
    out0 = model(torch.tensor([[steps[0][0]]]), cache=first).logits[0, -1]
    assert (out0 - reference[0][0]).abs().max() < 1e-4
    width = max(len(prompts[1]), len(prompts[2]))
    ids = torch.zeros(2, width, dtype=torch.long)
    valid = torch.zeros(2, width, dtype=torch.bool)
    for row, p in enumerate(prompts[1:]):
        ids[row, width - len(p) :] = torch.tensor(p)
        valid[row, width - len(p) :] = True
    late = LatentCache(model.config, 2, 32)
    model(ids, attention_mask=valid, cache=late)
    cache = LatentCache.concat([first, late], max_length=40)
    assert cache.batch_size == 3
    for k in range(3):  # steps[0][1:] with steps[1][:3], steps[2][:3]
        tokens = torch.tensor([[steps[0][k + 1]], [steps[1][k]], [steps[2][k]]])
        logits = model(tokens, cache=cache).logits[:, -1]
        for row, (seq, step) in enumerate(((0, k + 1), (1, k), (2, k))):
            assert (logits[row] - reference[seq][step]).abs().max() < 1e-4, (row, k)
    cache.select([2])  # 0 and 1 finish (or their clients go away); 2 continues alone
    last = model(torch.tensor([[steps[2][3]]]), cache=cache).logits[0, -1]
    assert (last - reference[2][3]).abs().max() < 1e-4
    assert cache.batch_size == 1 and cache.rows.shape[1] == 1
