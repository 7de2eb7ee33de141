"""An untied output head ``nn.Linear(d, V)`` of a user model is found by its embedding's shape and takes AdamW."""

import warnings

import pytest
import torch
from torch import nn

from k2lab.optim import OptimizerConfig, build_optimizer, parameter_groups


class GPTish(nn.Module):
    """Token table [V, d], position table [T, d] with T = 4d (the shape of every MLP up-projection)."""

    def __init__(self, vocab: int = 65, width: int = 32, tied: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(4 * width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(2)
        )
        self.head = nn.Linear(width, vocab)
        if tied:
            self.head.weight = self.wte.weight


def kinds(model: nn.Module) -> dict[str, str]:
    groups = parameter_groups(model, OptimizerConfig(name="muon"))
    return {name: g["kind"] for g in groups for name in g["names"]}


@pytest.mark.filterwarnings("error::UserWarning")
def test_untied_head_takes_adamw_and_hidden_matrices_muon():
    """The head nn.Linear(32, 65), not named lm_head, was orthogonalised by Muon like a hidden matrix."""
    routed = kinds(GPTish())
    assert routed["head.weight"] == routed["head.bias"] == "adamw"
    assert routed["wte.weight"] == routed["wpe.weight"] == "adamw"
    hidden = [f"blocks.{i}.{j}.weight" for i in range(2) for j in (0, 2)]
    assert all(routed[name] == "muon" for name in hidden)  # [4d, d] like wpe, but two of them: no head
    model = GPTish()
    optimizer = build_optimizer(model, OptimizerConfig(name="muon"), verbose=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()


@pytest.mark.filterwarnings("error::UserWarning")
def test_square_tables_and_tied_heads_name_no_head():
    """A [d, d] table cannot tell a head from a hidden [d, d] matrix; a tied head is the embedding's."""
    square = nn.Sequential(nn.Embedding(32, 32), nn.Linear(32, 32), nn.Linear(32, 64))
    assert kinds(square)["1.weight"] == "muon"
    routed = kinds(GPTish(tied=True))  # wpe's two [4d, d] candidates, but the model has its (tied) head
    assert routed["wte.weight"] == "adamw" and routed["blocks.0.0.weight"] == "muon"


def test_several_candidates_and_no_head_warn():
    """Vocabulary 4d: the head and both MLP up-projections are [V, d]; none is taken, and the user is told."""
    model = GPTish(vocab=128)
    with pytest.warns(UserWarning, match=r"blocks\.0\.0, blocks\.1\.0, head .* name it lm_head"):
        routed = kinds(model)
    assert routed["head.weight"] == "muon"
    model.lm_head = model.head  # named as k2lab names its head: taken by name, no warning
    del model.head
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kinds(model)["lm_head.weight"] == "adamw"
