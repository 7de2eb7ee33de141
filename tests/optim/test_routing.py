"""Which rule a parameter takes: k2lab's models exactly as before, user models by module type."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from k2lab import build_model, load_preset
from k2lab.optim import OptimizerConfig, build_optimizer, parameter_groups
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.vision.vlm import build_vlm

# parameter_groups of these models as computed by the name-and-ndim rule before module types were used
BEFORE = json.loads((Path(__file__).parent / "data" / "k2lab_grouping_before.json").read_text())


@pytest.mark.filterwarnings("error::UserWarning")  # k2-nano's lm_head has the shape of its MLP matrices
@pytest.mark.parametrize(("preset", "per_head"), [("k2-nano", False), ("k3-nano", True), ("k25-nano", False)])
def test_k2lab_models_group_exactly_as_before(preset: str, per_head: bool):
    """Module-type routing must not move one parameter of k2lab's own models (training stays bit-identical)."""
    vision = preset == "k25-nano"
    model = build_vlm(load_vlm_preset(preset), seed=0) if vision else build_model(load_preset(preset))
    groups = parameter_groups(model, OptimizerConfig(per_head_muon=per_head))
    got = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"} for g in groups]
    assert got == BEFORE[preset]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.c1 = nn.Conv1d(4, 6, 3)
        self.bn = nn.BatchNorm2d(8)
        self.ln2d = nn.LayerNorm([4, 8])  # a 2-D norm weight: not a matrix
        self.fc = nn.Linear(8, 2)
        self.grid = nn.Parameter(torch.zeros(2, 3, 4, 5))  # 4-D, no owner type


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(100, 32)
        self.ln_f = nn.LayerNorm(32)
        self.head = nn.Linear(32, 100, bias=False)
        self.head.weight = self.tok_emb.weight
        self.block = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        self.table = nn.Parameter(torch.zeros(3, 8, 8))  # 3-D but not k2lab experts


def kinds(model: nn.Module) -> dict[str, str]:
    groups = parameter_groups(model, OptimizerConfig(name="muon"))
    return {name: g["kind"] for g in groups for name in g["names"]}


def test_user_convolutions_norms_and_other_tensors_go_to_adamw():
    """Conv2d kernels went to Muon (build_optimizer then failed), a Conv1d kernel [out, in, k] became k
    'experts', and a 2-D LayerNorm weight was orthogonalised."""
    routed = kinds(ConvNet())
    assert routed == {
        "conv.weight": "adamw",
        "conv.bias": "adamw",
        "c1.weight": "adamw",
        "c1.bias": "adamw",
        "bn.weight": "adamw",
        "bn.bias": "adamw",
        "ln2d.weight": "adamw",
        "ln2d.bias": "adamw",
        "fc.weight": "muon",
        "fc.bias": "adamw",
        "grid": "adamw",
    }
    build_optimizer(ConvNet(), OptimizerConfig(name="muon"), verbose=False)


def test_user_embedding_and_its_tied_head_go_to_adamw():
    """nn.Embedding named tok_emb (and the head tied to it) went to Muon though the docstring promises AdamW."""
    routed = kinds(TinyLM())
    assert routed["tok_emb.weight"] == "adamw"
    assert routed["table"] == "adamw"
    assert routed["block.self_attn.in_proj_weight"] == "muon"
    assert routed["block.linear1.weight"] == "muon"
    assert routed["block.norm1.weight"] == "adamw"
    model = TinyLM()
    optimizer = build_optimizer(model, OptimizerConfig(name="muon"), verbose=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
