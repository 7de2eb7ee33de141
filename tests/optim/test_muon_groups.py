"""A Muon parameter group is checked and set up the same way from the constructor, ``add_param_group`` and
``load_state_dict``; bad arguments are refused as torch.optim refuses them."""

import math

import pytest
import torch
from torch import nn

from k2lab import hardware
from k2lab.optim import Muon, MuonClip, OptimizerConfig


def matrix(rows: int = 64, cols: int = 48) -> nn.Parameter:
    return nn.Parameter(torch.randn(rows, cols))


def test_added_group_resolves_ns_dtype_like_the_constructor():
    """An added group kept ns_dtype None (fp32 Newton–Schulz, 2e-4 from torch.optim.Muon)."""
    torch.manual_seed(0)
    first, added = matrix(32, 48), matrix()
    reference = nn.Parameter(added.detach().clone())
    optimizer = Muon([first], lr=0.02)
    optimizer.add_param_group({"params": [added]})
    assert optimizer.param_groups[1]["ns_dtype"] == optimizer.param_groups[0]["ns_dtype"] is not None
    torch_muon = torch.optim.Muon([reference], lr=0.02)
    grad = torch.randn(64, 48)
    added.grad, reference.grad = grad.clone(), grad.clone()
    optimizer.step()
    torch_muon.step()
    bf16 = optimizer.param_groups[1]["ns_dtype"] == torch.bfloat16
    torch.testing.assert_close(added, reference, rtol=0, atol=1e-6 if bf16 else 1e-3)


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ({"params": [nn.Parameter(torch.zeros(24))]}, "2-D matrices"),
        ({"params": [matrix()], "kind": "bogus"}, "kind must be"),
        ({"params": [matrix()], "lr": math.nan}, "lr must be >= 0"),
        ({"params": [matrix()], "ns_coefficients": (1.0, 2.0)}, "exactly 3"),
    ],
)
def test_added_group_is_validated_and_not_kept(group: dict, message: str):
    """A 1-D bias in a Muon group and kind='bogus' were accepted, then step failed."""
    optimizer = Muon([matrix()])
    with pytest.raises(ValueError, match=message):
        optimizer.add_param_group(group)
    assert len(optimizer.param_groups) == 1


def test_torch_muon_state_loads_and_steps():
    """torch.optim.Muon's groups have no 'kind' (nor row_blocks, ns_dtype, ...): step raised KeyError."""
    torch.manual_seed(0)
    weight = matrix()
    source = torch.optim.Muon([weight], lr=0.02)
    weight.grad = torch.randn_like(weight)
    source.step()
    optimizer = Muon([weight], lr=0.5)
    optimizer.load_state_dict(source.state_dict())
    group = optimizer.param_groups[0]
    assert group["kind"] == "muon" and group["lr"] == 0.02 and group["ns_dtype"] is not None
    optimizer.step()
    assert weight.isfinite().all()


@pytest.mark.parametrize(
    "arguments",
    [
        {"lr": math.nan},
        {"weight_decay": math.nan},
        {"momentum": math.nan},
        {"lr": -1.0},
        {"ns_coefficients": (1.0, 2.0)},
        {"ns_steps": 2.5},
    ],
)
def test_bad_arguments_are_refused(arguments: dict):
    """NaN lr / weight_decay passed ``lr < 0`` and made every weight NaN."""
    with pytest.raises(ValueError):
        Muon([matrix()], **arguments)


def test_complex_parameters_are_refused():
    with pytest.raises(ValueError, match="complex"):
        Muon([nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat))])


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_sparse_gradients_are_refused(kind: str):
    """A sparse embedding gradient failed deep inside lerp_ with NotImplementedError."""
    embedding = nn.Embedding(20, 8, sparse=True)
    optimizer = Muon([{"params": embedding.parameters(), "kind": kind}])
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        optimizer.step()


@pytest.fixture
def machine(monkeypatch):
    """``machine("avx512_bf16")`` / ``machine("avx2")``: the hardware probe sees a CPU that multiplies bf16
    natively (measured 6× its fp32 rate) or one that would emulate it; no forcing variable set."""
    for variable in (hardware.ENV_ALL, *hardware.ENV_PATH.values()):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(hardware, "cpu_rates", lambda: {"fp32": 1e11, "bf16": 6e11})

    def switch(flag: str) -> None:
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", flag}))

    return switch


@pytest.mark.parametrize(
    ("asked", "on_avx2"),
    [(None, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["auto", "forced-bf16"],
)
def test_state_saves_the_ns_dtype_request_and_resolves_it_where_it_loads(machine, asked, on_avx2):
    """The state saved bf16, resolved on an avx512_bf16 machine, and a resume on an AVX2-only one ran
    Newton–Schulz in emulated bf16 (~250× slower); a forced dtype stays forced."""
    machine("avx512_bf16")
    weight = matrix()
    saved = Muon([weight], ns_dtype=asked)
    assert saved.param_groups[0]["ns_dtype"] == torch.bfloat16
    weight.grad = torch.randn_like(weight)
    saved.step()
    state = saved.state_dict()
    assert (
        state["param_groups"][0]["ns_dtype"] == asked and "ns_dtype_request" not in state["param_groups"][0]
    )
    machine("avx2")
    resumed = Muon([weight])
    resumed.load_state_dict(state)
    assert resumed.param_groups[0]["ns_dtype"] == on_avx2
    assert resumed.state_dict()["param_groups"][0]["ns_dtype"] == asked  # saved again as asked


@pytest.mark.parametrize(
    ("started", "resumed", "on_avx2"),
    [("auto", "auto", torch.float32), ("bf16", "bf16", torch.bfloat16), ("bf16", "fp32", torch.float32)],
)
def test_resumed_run_takes_its_own_ns_precision_on_its_machine(machine, started, resumed, on_avx2):
    """A run resumes with its own ``ns_precision`` (a resumable setting), chosen on the machine it runs on."""
    machine("avx512_bf16")
    model = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 24))
    first = MuonClip(model, OptimizerConfig(name="muon", ns_precision=started), verbose=False)
    assert {g["ns_dtype"] for g in first.param_groups} == {torch.bfloat16}
    state = first.state_dict()
    machine("avx2")
    second = MuonClip(model, OptimizerConfig(name="muon", ns_precision=resumed), verbose=False)
    second.load_state_dict(state)
    assert {g["ns_dtype"] for g in second.param_groups} == {on_avx2}
