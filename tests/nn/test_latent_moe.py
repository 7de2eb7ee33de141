"""K3 Stable LatentMoE and its SiTU-GLU activation against the formulas and a per-token reference."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from k2lab import build_model
from k2lab.nn.activations import GLUActivation, mlp_activation, situ_glu, swiglu
from k2lab.nn.experts import RoutedExperts
from k2lab.nn.mlp import GatedMLP, SwiGLU
from k2lab.nn.moe import MoE
from k2lab.presets import load_preset

# ---- SiTU-GLU -----------------------------------------------------------------------------------------------

huge = st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_infinity=False)


def situ_reference(g: torch.Tensor, u: torch.Tensor, b1: float = 4.0, b2: float = 25.0) -> torch.Tensor:
    g, u = g.double(), u.double()
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(huge, huge), min_size=1, max_size=64), st.sampled_from([torch.float32, torch.bfloat16])
)
def test_situ_glu_is_bounded_and_equals_the_formula(pairs, dtype):
    gate = torch.tensor([p[0] for p in pairs], dtype=dtype)
    up = torch.tensor([p[1] for p in pairs], dtype=dtype)
    out = situ_glu(gate, up)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert out.abs().max() <= 4.0 * 25.0
    want = situ_reference(gate, up).to(dtype)  # same (rounded) inputs, float64 formula
    torch.testing.assert_close(out, want, rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-6)


def test_situ_glu_limits_infinities_and_fp32_compute():
    g = torch.tensor([float("inf"), float("-inf"), 1e30, -1e30, 0.0])
    u = torch.tensor([float("inf"), 1e30, float("-inf"), 3.0, 7.0])
    assert situ_glu(g, u).tolist() == [100.0, 0.0, -100.0, 0.0, 0.0]
    # bf16 inputs are computed in fp32, then rounded once
    gb, ub = torch.randn(256).bfloat16() * 8, torch.randn(256).bfloat16() * 40
    assert torch.equal(situ_glu(gb, ub), situ_glu(gb.float(), ub.float()).bfloat16())


def test_activation_from_config_and_dense_mlp():
    config = load_preset("k2-nano", mlp_activation="situ_glu", situ_beta1=2.0, situ_beta2=10.0)
    act = mlp_activation(config)
    assert act == GLUActivation("situ_glu", 2.0, 10.0)
    assert mlp_activation(load_preset("k2-nano")) == GLUActivation("swiglu")
    torch.manual_seed(0)
    mlp = GatedMLP(8, 12, act)
    x = torch.randn(5, 8) * 30
    g, u = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    want = (situ_reference(g, u, 2.0, 10.0).float()) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    # the K2 name and default are unchanged: SwiGLU(hidden, inter) is silu(g) ⊙ u
    plain = SwiGLU(8, 12)
    plain.load_state_dict(mlp.state_dict())
    assert plain.activation is swiglu
    torch.testing.assert_close(plain(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))


# ---- Stable LatentMoE ---------------------------------------------------------------------------------------

LATENT = 6


def latent_config(**overrides):
    fields = dict(moe_latent_size=LATENT, mlp_activation="situ_glu", n_shared_experts=2) | overrides
    return load_preset("k2-nano", **fields)


def latent_moe(seed: int = 0, std: float = 0.3, **overrides) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(latent_config(**overrides))
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else std * torch.randn_like(p)
            )
        moe.router.e_score_correction_bias.normal_(0, 0.05)
    return moe


def test_latent_moe_structure_and_shapes():
    config = latent_config()
    moe = latent_moe()
    D, E, F_ = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    assert moe.latent_down.weight.shape == (LATENT, D)
    assert moe.latent_up.weight.shape == (D, LATENT)
    assert moe.latent_norm.weight.shape == (LATENT,)
    assert moe.experts.gate_proj.shape == (E, F_, LATENT)
    assert moe.experts.down_proj.shape == (E, LATENT, F_)
    assert moe.router.weight.shape == (E, D)  # the router reads the full x
    assert moe.shared_experts.gate_proj.weight.shape == (F_ * 2, D)
    assert moe.experts.activation == moe.shared_experts.activation == GLUActivation("situ_glu")
    x = torch.randn(2, 7, D)
    assert moe(x).shape == (2, 7, D)
    # the K2 MoE has none of it, and its parameter names are unchanged
    k2 = MoE(load_preset("k2-nano"))
    assert k2.latent_down is None and k2.latent_norm is None and k2.latent_up is None
    assert all(
        name.split(".")[0] in {"router", "experts", "shared_experts"} for name, _ in k2.named_parameters()
    )
    assert k2.experts.activation == GLUActivation("swiglu")


def dense_reference(moe: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    """y_n = shared(x_n) + W_up RMSNorm(Σ_k p_k E_k(W_down x_n)), one token and one expert at a time."""
    routing = moe.router(x_ND)
    ex, eps = moe.experts, moe.latent_norm.eps
    out = []
    for n in range(x_ND.shape[0]):
        z = moe.latent_down.weight @ x_ND[n]
        u = torch.zeros(LATENT, dtype=torch.float64)
        for slot in range(routing.indices.shape[1]):
            e = int(routing.indices[n, slot])
            h = situ_reference(ex.gate_proj[e] @ z, ex.up_proj[e] @ z).float()
            u += routing.weights[n, slot].double() * (ex.down_proj[e] @ h).double()
        normed = u / torch.sqrt(u.pow(2).mean() + eps) * moe.latent_norm.weight.double()
        sh = moe.shared_experts
        gs, us = sh.gate_proj.weight @ x_ND[n], sh.up_proj.weight @ x_ND[n]
        shared = sh.down_proj.weight @ situ_reference(gs, us).float()
        out.append(moe.latent_up.weight @ normed.float() + shared)
    return torch.stack(out)


def test_latent_moe_matches_per_token_reference_and_gradients_flow():
    moe = latent_moe().train()
    x = torch.randn(3, 5, moe.router.weight.shape[1], requires_grad=True)
    y = moe(x)
    want = dense_reference(moe, x.detach().reshape(-1, x.shape[-1])).view_as(y)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    for name, p in [("x", x), *moe.named_parameters()]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_latent_moe_without_norm_is_the_plain_up_projection():
    """``moe_latent_norm`` False (released ``latent_moe_use_norm: false``): y = E_shared(x) + W_up u."""
    normed = latent_moe()
    plain = latent_moe(moe_latent_norm=False)
    assert plain.latent_norm is None and "latent_norm.weight" not in dict(plain.named_parameters())
    plain.load_state_dict({k: v for k, v in normed.state_dict().items() if "latent_norm" not in k})
    x = torch.randn(2, 4, normed.router.weight.shape[1])
    x_ND = x.reshape(-1, x.shape[-1])
    routing = plain.router(x_ND)
    u = plain.experts(plain.latent_down(x_ND), routing.indices, routing.weights)
    want = (plain.latent_up(u) + plain.shared_experts(x_ND)).view_as(x)
    torch.testing.assert_close(plain(x), want, rtol=1e-5, atol=1e-6)
    assert (plain(x) - normed(x)).abs().max() > 1e-3  # the norm is really gone


def test_routed_sum_is_fp32_in_latent_path():
    torch.manual_seed(0)
    experts = RoutedExperts(4, 8, 16)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.5)
    x = torch.randn(9, 8).bfloat16()
    indices = torch.stack([torch.randperm(4)[:3] for _ in range(9)])
    weights = torch.rand(9, 3)
    y32 = experts(x, indices, weights, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and experts(x, indices, weights).dtype == torch.bfloat16
    # = the fp32 sum of each pick's weighted row (one pick at a time: a single term, never rounded to bf16)
    per_pick = [
        experts(x, indices[:, s : s + 1], weights[:, s : s + 1], out_dtype=torch.float32) for s in range(3)
    ]
    torch.testing.assert_close(y32, sum(per_pick), rtol=1e-6, atol=1e-6)
    # a bf16 MoE runs end to end and hands back bf16
    moe = latent_moe().to(torch.bfloat16)
    moe.router.float()
    assert moe(torch.randn(2, 3, moe.router.weight.shape[1]).bfloat16()).dtype == torch.bfloat16


def test_situ_bounds_expert_hidden_where_swiglu_explodes():
    """With huge weights, every expert hidden (routed and shared) stays within β1·β2 = 100 under SiTU-GLU."""
    peaks = {}
    for kind in ("situ_glu", "swiglu"):
        moe = latent_moe(std=20.0, mlp_activation=kind)
        seen = []
        act = moe.experts.activation

        def recording(g, u, act=act, seen=seen):
            h = act(g, u)
            seen.append(h.detach().abs().max())
            return h

        moe.experts.activation = recording
        moe.shared_experts.activation = recording
        y = moe(torch.randn(4, 6, moe.router.weight.shape[1]) * 10)
        assert torch.isfinite(y).all()
        peaks[kind] = float(max(seen))
    assert peaks["situ_glu"] <= 100.0
    assert peaks["swiglu"] > 1e4


def test_latent_k3_style_model_trains_a_step():
    """The decoder builds the latent MoE from the config alone; init covers the new Linear / RMSNorm."""
    model = build_model(latent_config(moe_latent_size=8))
    moe = model.moe_layers()[0]
    assert moe.latent_norm.weight.eq(1).all() and moe.latent_down.weight.std() > 0
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    logits = model(ids).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
    loss.backward()
    assert math.isfinite(loss.item())
    assert moe.latent_up.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("latent", [None, LATENT])
def test_moe_records_scores_only_when_asked_in_training(latent):
    moe = latent_moe(moe_latent_size=latent).train()
    x = torch.randn(2, 5, moe.router.weight.shape[1])
    moe(x)
    assert moe.recorded_scores == []
    moe.record_scores = True
    moe(x)
    moe.eval()(x)  # evaluation passes are not a balancing batch
    assert len(moe.recorded_scores) == 1
    scores = moe.recorded_scores[0]
    assert scores.shape == (10, moe.experts.n_experts) and scores.dtype == torch.float32
    assert not scores.requires_grad
