"""The MTP objective: hand-derived alignment, ignore index, and the trainer with and without MTP modules."""

import pytest
import torch
import torch.nn.functional as F

from k2lab.train.config import load_train_config
from k2lab.train.metrics import read_metrics
from k2lab.train.mtp_loss import IGNORE_INDEX, mtp_loss
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
