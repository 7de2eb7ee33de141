"""QK-Clip on models without k2lab's MLA: a clear refusal instead of a silent no-op or an AttributeError."""

import pytest
import torch
from torch import nn

from k2lab.optim import MuonClip, OptimizerConfig, QKClip, parameter_groups


class EncoderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x)).sum()


class GPTNaming(nn.Module):
    """``blocks`` is a ModuleList here, not k2lab's ``blocks()`` method."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])


def encoder() -> nn.Module:
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), num_layers=2)


@pytest.mark.parametrize("make", [EncoderModel, encoder, GPTNaming])
def test_muonclip_without_mla_says_to_use_muon(make):
    """It reported max_logit 0.0 and clipped nothing (tau=0.001), or raised AttributeError /
    NotImplementedError from the layer discovery."""
    with pytest.raises(ValueError, match=r"MultiHeadLatentAttention.*name='muon'"):
        MuonClip(make(), OptimizerConfig(name="muonclip", qk_clip_tau=0.001), verbose=False)


@pytest.mark.parametrize("make", [encoder, GPTNaming])
def test_qk_clip_discovery_tolerates_user_layer_lists(make):
    """``model.layers`` without ``.attn`` and ``model.blocks`` as a ModuleList: no MLA, nothing to clip."""
    clip = QKClip(make())
    assert clip.layers == [] and clip.layer_indices == [] and clip.apply([]).clipped_heads == 0


def test_plain_muon_runs_on_a_model_without_mla():
    model = EncoderModel()
    optimizer = MuonClip(model, OptimizerConfig(name="muon"), verbose=False)
    model(torch.randn(2, 5, 32)).backward()
    stats = optimizer.step()
    assert stats["max_logit"] == 0.0 and stats["qk_clipped_heads"] == 0.0


def test_per_head_muon_without_k2lab_attention_is_refused():
    """per_head_muon=True found no head blocks and silently ran whole-matrix Muon."""
    with pytest.raises(ValueError, match="per_head_muon=False"):
        parameter_groups(EncoderModel(), OptimizerConfig(name="muon", per_head_muon=True))
