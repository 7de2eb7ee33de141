"""The fused head + cross-entropy equals F.cross_entropy over the head's logits: loss and both gradients."""

import pytest
import torch
import torch.nn.functional as F

from k2lab import build_model, load_preset
from k2lab.ops.linear_cross_entropy import (
    default_chunk_rows,
    linear_cross_entropy,
    linear_cross_entropy_hits,
)
from tests.conftest import randomize

N, D, V = 70, 24, 50


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=generator).requires_grad_()
    weight = (0.5 * torch.randn(V, D, generator=generator)).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=generator)
    labels[::9] = -100
    return hidden, weight, labels


def loss_and_grads(loss_fn, hidden, weight, labels, factor: float = 1.0):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, labels)
    (factor * loss).backward()
    return loss.detach(), hidden.grad, weight.grad


def unfused(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels)


@pytest.mark.parametrize("chunk_rows", [None, 1, 16, 33, N])
def test_equals_cross_entropy_over_the_logits(chunk_rows: int | None) -> None:
    hidden, weight, labels = inputs()
    want = loss_and_grads(unfused, hidden, weight, labels, factor=3.0)
    fused = lambda h, w, y: linear_cross_entropy(h, w, y, chunk_rows=chunk_rows)  # noqa: E731
    got = loss_and_grads(fused, hidden, weight, labels, factor=3.0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_batched_shapes_and_frozen_weight() -> None:
    hidden, weight, labels = inputs(1)
    weight.requires_grad_(False)
    want = loss_and_grads(unfused, hidden, weight, labels)
    fold = lambda h, w, y: linear_cross_entropy(h.reshape(7, 10, D), w, y.reshape(7, 10))  # noqa: E731
    got = loss_and_grads(fold, hidden, weight, labels)
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-5, atol=1e-7)
    assert got[2] is None


def test_without_grad_it_only_scores(monkeypatch) -> None:
    hidden, weight, labels = inputs(2)  # both require grad, as a model's head weight does in validation
    monkeypatch.setattr(
        "k2lab.ops.linear_cross_entropy._chunk_grads", lambda *a: pytest.fail("gradient formed")
    )
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, unfused(hidden, weight, labels).detach(), rtol=1e-6, atol=0)


def test_autocast_bf16_matches_the_unfused_autocast_step() -> None:
    """Under autocast the head's products run in bf16 and the softmax in fp32 on both paths."""
    hidden, weight, labels = inputs(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(unfused, hidden, weight, labels)
        got = loss_and_grads(linear_cross_entropy, hidden, weight, labels)
    assert got[1].dtype == got[2].dtype == torch.float32
    for g, w in zip(got, want, strict=True):  # bf16 rounding of the gradient rows, ~2⁻⁸ relative
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("autocast", [False, True])
def test_large_losses_come_from_logsumexp(autocast: bool) -> None:
    """Rows whose label probability nears fp32 underflow (ℓ > 80) take logsumexp(z) − z_y; −log p_y would
    be inf (p_y = 0) or lose digits (denormal). Losses here reach ≈ 130 and ≈ 1,000."""
    hidden, weight, labels = inputs(4)
    with torch.no_grad():
        hidden[:4] *= 40.0  # confident rows
        logits = F.linear(hidden, weight)
        labels[:4] = logits[:4].argmin(-1)  # and wrong
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = loss_and_grads(unfused, hidden, weight, labels)
        got = loss_and_grads(linear_cross_entropy, hidden, weight, labels)
        per_row = F.cross_entropy(F.linear(hidden[:4], weight).float(), labels[:4], reduction="none")
    assert per_row.min() > 80 and torch.isfinite(got[0])
    tolerance = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance)


@pytest.mark.parametrize("autocast", [False, True])
def test_the_accelerator_branch_takes_logsumexp_for_every_row(monkeypatch, autocast: bool) -> None:
    """Where reading a flag back would stop the host (an accelerator), every row's ℓ is logsumexp(z) − z_y
    with no check; run here on CPU by patching the device test, with the large-loss rows included."""
    monkeypatch.setattr("k2lab.ops.linear_cross_entropy._host_reads_cheaply", lambda device: False)
    hidden, weight, labels = inputs(6)
    with torch.no_grad():
        hidden[:3] *= 40.0
        labels[:3] = F.linear(hidden, weight)[:3].argmin(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = loss_and_grads(unfused, hidden, weight, labels)
        got = loss_and_grads(linear_cross_entropy, hidden, weight, labels)
    tolerance = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance)


def test_bf16_hidden_and_head_without_autocast() -> None:
    hidden, weight, labels = inputs(5)
    hidden, weight = (x.detach().bfloat16().requires_grad_() for x in (hidden, weight))
    want = loss_and_grads(unfused, hidden, weight, labels)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, labels)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-3)


def test_chunk_rows_bound_the_logits() -> None:
    assert default_chunk_rows(8192) == 2048  # k2-mini's 2,048 training rows in one chunk
    assert default_chunk_rows(163_840) == 102  # K2's vocabulary: 64 MiB of fp32 logits a chunk
    assert default_chunk_rows(10**9) == 16


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_returns_the_loss_of_its_logits(tied: bool) -> None:
    """With tied embeddings the head's gradient and the embedding's accumulate in one weight."""
    torch.manual_seed(0)
    model = randomize(build_model(load_preset("k2-nano", tie_word_embeddings=tied))).train()
    assert (model.lm_head.weight is model.embed.weight) == tied
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    model.zero_grad()
    logits = model(ids).logits
    want = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    want.backward()
    want_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    out = model(ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        if name in want_grads:
            torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="without cache and logits_mask"):
        model(ids, labels=labels, logits_mask=torch.ones_like(ids, dtype=torch.bool))


@pytest.mark.parametrize("accelerator", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 16])
def test_hits_count_the_rows_whose_argmax_is_the_label(monkeypatch, chunk_rows, accelerator: bool) -> None:
    """``linear_cross_entropy_hits``: the same loss and gradients, and #{valid i : argmax z_i = y_i} without
    gradient, across chunks and on both branches; ignored rows never count."""
    if accelerator:
        monkeypatch.setattr("k2lab.ops.linear_cross_entropy._host_reads_cheaply", lambda device: False)
    hidden, weight, labels = inputs(3)
    best = F.linear(hidden, weight).argmax(-1).detach()
    labels[1::2] = best[1::2]  # about half the rows hit (the ignored ones among them do not count)
    labels[::9] = -100
    want = int(((best == labels) & (labels != -100)).sum())
    assert 20 < want < N - 20
    loss, hits = linear_cross_entropy_hits(hidden, weight, labels, chunk_rows=chunk_rows)
    assert hits.dtype == torch.int64 and int(hits) == want and not hits.requires_grad
    got = loss_and_grads(
        lambda *a: linear_cross_entropy_hits(*a, chunk_rows=chunk_rows)[0], hidden, weight, labels
    )
    for g, w in zip(got, loss_and_grads(unfused, hidden, weight, labels), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
