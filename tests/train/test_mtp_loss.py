"""The MTP objective: hand-derived alignment, ignore index, and the trainer with and without MTP modules."""

import pytest
import torch
import torch.nn.functional as F

from k2lab.train.config import load_train_config
from k2lab.train.metrics import read_metrics
from k2lab.train.mtp_loss import IGNORE_INDEX, fused_mtp_loss, mtp_loss
from k2lab.train.trainer import run_training
from tests.conftest import tiny_recipe


def test_depth_k_row_i_is_scored_against_t_i_plus_k_plus_1():
    # labels[:, i] = t_{i+1}: stream t = 10, 11, …, 15; depth 1 at row i targets t_{i+2} = labels[:, i+1]
    labels = torch.tensor([[11, 12, 13, 14, 15]])
    V = 20
    depth1 = torch.full((1, 5, V), -10.0)
    depth2 = torch.full((1, 5, V), -10.0)
    for i in range(5):
        depth1[0, i, 12 + i if 12 + i < V else 0] = 10.0  # exactly t_{i+2}
        depth2[0, i, (13 + i) % V] = 10.0  # exactly t_{i+3}
    result = mtp_loss([depth1, depth2], labels)
    assert result.top1.item() == 1.0 and result.targets == 4
    assert result.loss.item() < 1e-6
    # the hand-written mean over depths of the aligned cross-entropies
    wrong = torch.zeros(1, 5, V)
    expected = (
        F.cross_entropy(wrong[0, :4], labels[0, 1:]) + F.cross_entropy(depth2[0, :3], labels[0, 2:])
    ) / 2
    torch.testing.assert_close(mtp_loss([wrong, depth2], labels).loss, expected)


def test_ignored_targets_are_skipped_like_the_main_loss():
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 3]])
    logits = torch.randn(1, 4, 5)
    result = mtp_loss([logits], labels)
    kept = torch.tensor([0, 2])  # rows whose target labels[:, i + 1] is not ignored
    torch.testing.assert_close(result.loss, F.cross_entropy(logits[0, kept], labels[0, kept + 1]))
    assert result.targets == 2
    with pytest.raises(ValueError, match="longer"):
        mtp_loss([logits] * 4, labels)


@pytest.mark.parametrize("autocast", [False, True])
def test_the_fused_loss_equals_the_reference_over_the_logits(autocast: bool):
    """``fused_mtp_loss`` on final-normed states and the head equals ``mtp_loss`` on their logits: loss,
    top-1, targets and the gradients of both states and the head (two depths, ignored labels, fp32 and bf16
    autocast)."""
    generator = torch.Generator().manual_seed(0)
    B, T, D, V = 2, 9, 16, 40
    states = [torch.randn(B, T, D, generator=generator).requires_grad_() for _ in range(2)]
    weight = (0.5 * torch.randn(V, D, generator=generator)).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=generator)
    with torch.no_grad():  # depth 1 right on a few rows, so top-1 is neither 0 nor 1
        labels[:, 2:6] = F.linear(states[0][:, 1:5], weight).argmax(-1)
    labels[0, 3] = labels[1, 7] = IGNORE_INDEX
    results = []
    for loss_of in (
        lambda: mtp_loss([F.linear(s, weight) for s in states], labels),
        lambda: fused_mtp_loss(states, weight, labels),
    ):
        for tensor in (*states, weight):
            tensor.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            result = loss_of()
        result.loss.backward()
        results.append((result, [t.grad.clone() for t in (*states, weight)]))
    (want, want_grads), (got, got_grads) = results
    assert 0 < want.top1.item() < 1 and got.targets == want.targets == B * (T - 1) - 2
    tolerance = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.top1, want.top1)
    torch.testing.assert_close(got.loss, want.loss, **tolerance)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **tolerance)
    with pytest.raises(ValueError, match="longer"):
        fused_mtp_loss(states * 5, weight, labels)


def run(tmp_path, corpus, name, steps, **overrides):
    path = tiny_recipe(
        tmp_path / f"{name}.toml", corpus, steps=steps, out=str(tmp_path / name), eval_every=steps
    )
    run_training(load_train_config(path, **overrides))
    return read_metrics(tmp_path / name)


def test_mtp_training_logs_its_loss_and_top1_and_learns(tmp_path, tiny_corpus):
    rows = run(tmp_path, tiny_corpus, "mtp", 16, model_overrides={"num_nextn_predict_layers": 1})
    assert all({"mtp_loss", "mtp_top1"} <= set(row) for row in rows)
    assert "expert_load/layer2" in rows[0]  # the MTP block's MoE is HF layer num_hidden_layers = 2
    assert "max_logit/layer2" in rows[0]
    first, last = rows[0]["mtp_loss"], rows[-1]["mtp_loss"]
    assert last < first - 0.5, (first, last)
    assert 0.0 <= rows[-1]["mtp_top1"] <= 1.0 and rows[-1]["mtp_top1"] > rows[0]["mtp_top1"]


def test_mtp_weight_zero_leaves_the_main_run_as_without_mtp(tmp_path, tiny_corpus):
    """Without MTP modules nothing of MTP runs or is logged; with them at λ = 0 the main losses match."""
    plain = run(tmp_path, tiny_corpus, "plain", 2)
    assert not any("mtp_loss" in row for row in plain)
    silent = run(
        tmp_path, tiny_corpus, "zero", 2, model_overrides={"num_nextn_predict_layers": 1}, mtp_loss_weight=0.0
    )
    # same initial weights, data and updates of the main model (the gradient-norm reduction over more
    # tensors rounds differently in the last bits); with λ > 0 the MTP gradient also reaches the trunk
    assert silent[0]["loss"] == plain[0]["loss"]
    assert [row["loss"] for row in silent] == pytest.approx([row["loss"] for row in plain], rel=1e-5)
