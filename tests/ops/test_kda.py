"""KDA ops: ``recurrent_kda`` and the chunked WY form ``chunk_kda`` against flash-linear-attention's naive
references (fp32, max abs diff ≤ 1e-5), gradients of one form against the other, state hand-over, strong
decays, dtypes and the dispatch function."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k2lab.ops import kda as kda_ops
from k2lab.ops.kda import chunk_kda, kda, recurrent_kda, recurrent_kda_states
from tests.fla_naive import load_naive

PARITY = 1e-5
GRAD_PARITY = 1e-4


@pytest.fixture(scope="module")
def naive():
    return load_naive("kda")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are small: a second intra-op thread only adds synchronisation, which turns into long
    stalls when the other core is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gate(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Log-decays: Kimi Linear's −softplus (A = 1), K3's lower-bounded −5·sigmoid, and a strong unbounded
    −exp(2)·softplus(x + 2) (≈ −16 per step, far below −80 per 16 tokens)."""
    if kind == "softplus":
        return -F.softplus(x)
    if kind == "lower_bound":
        return -5 * torch.sigmoid(x)
    if kind == "strong":
        return -math.exp(2) * F.softplus(x + 2)
    raise ValueError(kind)


def make_inputs(
    T: int,
    *,
    B: int = 2,
    H: int = 2,
    HV: int = 4,
    K: int = 32,
    V: int = 48,
    kind: str = "softplus",
    seed: int = 0,
    state: bool = True,
) -> dict[str, torch.Tensor | None]:
    """Inputs as the layer produces them: L2-normalised q, k; v ~ N(0, 1); beta = sigmoid(N); a log-decay g."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "q": F.normalize(randn(B, T, H, K), dim=-1),
        "k": F.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, HV, V),
        "g": gate(randn(B, T, HV, K), kind),
        "beta": torch.sigmoid(randn(B, T, HV)),
        "initial_state": randn(B, HV, K, V) if state else None,
    }


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize("T", [1, 7, 65, 130])
@pytest.mark.parametrize("kind", ["softplus", "lower_bound", "strong"])
def test_recurrent_matches_fla_naive_recurrent(naive, T, kind):
    x = make_inputs(T, kind=kind, seed=T)
    o, s = recurrent_kda(**x, output_final_state=True)
    o_ref, s_ref = naive.naive_recurrent_kda(**x, output_final_state=True)
    assert o.shape == (2, T, 4, 48) and s.shape == (2, 4, 32, 48)
    assert max_diff(o, o_ref) <= PARITY and max_diff(s, s_ref) <= PARITY


@pytest.mark.parametrize("T", [1, 7, 65, 130])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("kind", ["softplus", "lower_bound", "strong"])
def test_chunk_matches_fla_naive_recurrent(naive, T, chunk_size, kind):
    x = make_inputs(T, kind=kind, seed=T + chunk_size)
    o, s = chunk_kda(**x, output_final_state=True, chunk_size=chunk_size)
    o_ref, s_ref = naive.naive_recurrent_kda(**x, output_final_state=True)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert max_diff(o, o_ref) <= PARITY and max_diff(s, s_ref) <= PARITY


@pytest.mark.parametrize(("T", "chunk_size"), [(64, 16), (96, 32), (128, 64), (64, 64)])
@pytest.mark.parametrize("kind", ["softplus", "lower_bound"])
def test_chunk_matches_fla_naive_chunk(naive, T, chunk_size, kind):
    """fla's naive chunk form takes only T divisible by its chunk size."""
    x = make_inputs(T, kind=kind, seed=3 * T + chunk_size)
    o, s = chunk_kda(**x, output_final_state=True, chunk_size=chunk_size)
    o_ref, s_ref = naive.naive_chunk_kda(**x, output_final_state=True, chunk_size=chunk_size)
    assert max_diff(o, o_ref) <= PARITY and max_diff(s, s_ref) <= PARITY


def test_chunk_without_state_single_head_square_widths(naive):
    x = make_inputs(50, B=1, H=3, HV=3, K=16, V=16, state=False, seed=11)
    o, s = chunk_kda(**x, scale=0.3, chunk_size=16)
    o_ref, _ = naive.naive_recurrent_kda(**x, scale=0.3)
    assert s is None and max_diff(o, o_ref) <= PARITY


# ------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    ("T", "chunk_size", "kind"), [(37, 16, "softplus"), (70, 32, "strong"), (64, 64, "lower_bound")]
)
def test_chunk_gradients_match_recurrent(T, chunk_size, kind):
    x = make_inputs(T, K=16, V=24, kind=kind, seed=T)
    gen = torch.Generator().manual_seed(1)
    weight_o, weight_s = torch.randn(2, T, 4, 24, generator=gen), torch.randn(2, 4, 16, 24, generator=gen)

    def grads(fn, **kwargs):
        leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
        o, s = fn(**leaves, output_final_state=True, **kwargs)
        ((o * weight_o).sum() + (s * weight_s).sum()).backward()
        return {name: t.grad for name, t in leaves.items()}

    got, want = grads(chunk_kda, chunk_size=chunk_size), grads(recurrent_kda)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        assert torch.isfinite(got[name]).all(), name
        assert max_diff(got[name], want[name]) <= GRAD_PARITY, name


# ------------------------------------------------------------------------------------- state hand-over


@pytest.mark.parametrize(("T", "split"), [(130, 64), (97, 40), (33, 1)])
def test_split_sequence_equals_full_run(T, split):
    """Prefill a prefix, carry its final state into the rest: the same outputs and final state."""
    x = make_inputs(T, seed=T + split)
    first = {n: t[:, :split] if n != "initial_state" else t for n, t in x.items()}
    second = {n: t[:, split:] for n, t in x.items() if n != "initial_state"}
    o_full, s_full = chunk_kda(**x, output_final_state=True, chunk_size=32)
    o1, s1 = chunk_kda(**first, output_final_state=True, chunk_size=32)
    o2, s2 = chunk_kda(**second, initial_state=s1, output_final_state=True, chunk_size=32)
    assert max_diff(torch.cat((o1, o2), dim=1), o_full) <= PARITY
    assert max_diff(s2, s_full) <= PARITY


def test_token_by_token_decode_after_chunked_prefill():
    x = make_inputs(40, seed=5)
    o_full, s_full = chunk_kda(**x, output_final_state=True)
    _, state = kda(
        **{n: t[:, :30] if n != "initial_state" else t for n, t in x.items()}, output_final_state=True
    )
    for t in range(30, 40):
        step = {n: x[n][:, t : t + 1] for n in ("q", "k", "v", "g", "beta")}
        o_t, state = kda(**step, initial_state=state, output_final_state=True)
        assert max_diff(o_t, o_full[:, t : t + 1]) <= PARITY
    assert max_diff(state, s_full) <= PARITY


def test_per_token_states_are_the_states_of_each_prefix():
    """recurrent_kda_states: the outputs of recurrent_kda and, at t, the final state of the first t+1 tokens
    (what speculative decoding continues from after accepting t+1 tokens of a verify window)."""
    x = make_inputs(5, seed=11)
    o, states = recurrent_kda_states(**x)
    o_ref, _ = recurrent_kda(**x)
    assert states.shape == (2, 5, 4, 32, 48) and states.dtype == torch.float32
    assert torch.equal(o, o_ref)
    for t in range(5):
        _, s_t = recurrent_kda(
            **{n: v[:, : t + 1] if n != "initial_state" else v for n, v in x.items()}, output_final_state=True
        )
        assert torch.equal(states[:, t], s_t)
    _, empty = recurrent_kda_states(**{n: v[:, :0] if n != "initial_state" else v for n, v in x.items()})
    assert empty.shape == (2, 0, 4, 32, 48)


# ---------------------------------------------------------------------------------------------- numerics


def test_extreme_decays_stay_finite_forward_and_backward():
    x = make_inputs(100, K=16, V=16, seed=2)
    gen = torch.Generator().manual_seed(3)
    x["g"] = torch.where(torch.rand(x["g"].shape, generator=gen) < 0.5, -1e4, -20.0) * torch.rand(
        x["g"].shape, generator=gen
    )
    leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
    o, s = chunk_kda(**leaves, output_final_state=True, chunk_size=64)
    (o.sum() + s.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert all(torch.isfinite(t.grad).all() for t in leaves.values())
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True)
    # cumulative decays of ~1e5 per chunk leave fp32 an absolute resolution of ~1e-2 in the exponent
    assert max_diff(o, o_ref) <= 1e-3 and max_diff(s, s_ref) <= 1e-3


def test_no_decay_is_the_plain_delta_rule(naive):
    x = make_inputs(45, seed=8)
    x["g"] = torch.zeros_like(x["g"])
    o, s = chunk_kda(**x, output_final_state=True, chunk_size=16)
    o_ref, s_ref = naive.naive_recurrent_kda(**x, output_final_state=True)
    assert max_diff(o, o_ref) <= PARITY and max_diff(s, s_ref) <= PARITY


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda])
def test_bf16_inputs_give_bf16_output_and_fp32_state(fn):
    x = make_inputs(20, seed=4)
    o32, s32 = fn(**x, output_final_state=True)
    low = {n: t.bfloat16() for n, t in x.items()}
    o, s = fn(**low, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert max_diff(o, o32) < 0.1


def test_empty_sequence_returns_initial_state():
    x = make_inputs(0, seed=0)
    o, s = chunk_kda(**x, output_final_state=True)
    assert o.shape == (2, 0, 4, 48) and torch.equal(s, x["initial_state"])


def test_shape_errors_name_the_tensor():
    x = make_inputs(8)
    with pytest.raises(ValueError, match="multiple"):
        chunk_kda(**{**x, "v": x["v"][:, :, :3], "g": x["g"][:, :, :3], "beta": x["beta"][:, :, :3]})
    with pytest.raises(ValueError, match="g must be"):
        recurrent_kda(**{**x, "g": x["g"][..., :5]})
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda(**x, chunk_size=48)


# ---------------------------------------------------------------------------------------------- dispatch


def test_dispatch_on_cpu_uses_ours(monkeypatch):
    calls = []
    monkeypatch.setattr(kda_ops, "chunk_kda", lambda *a, **kw: calls.append("chunk") or chunk_kda(*a, **kw))
    monkeypatch.setattr(
        kda_ops, "recurrent_kda", lambda *a, **kw: calls.append("rec") or recurrent_kda(*a, **kw)
    )
    x = make_inputs(9)
    kda(**x)
    kda(**{n: t[:, :1] if n != "initial_state" else t for n, t in x.items()})
    assert calls == ["chunk", "rec"]
    with pytest.raises(RuntimeError, match="fla"):
        kda(**x, backend="fla")


def test_dispatch_maps_arguments_to_fla_kernels(monkeypatch):
    """fla's kernels stand in as fakes (no GPU here): q, k passed as given, no in-kernel gate/beta/l2norm,
    fp32 initial state, and the fused recurrent kernel only for a gradient-free single token."""
    seen = []

    def fake_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, **flags):
        seen.append(("chunk", flags))
        return chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, flags["chunk_size"])

    def fake_fused(q, k, v, g, beta, scale, initial_state, output_final_state, **flags):
        seen.append(("fused", flags))
        return recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)

    monkeypatch.setattr(kda_ops, "_fla_kernels", lambda: (fake_chunk, fake_fused))
    monkeypatch.setattr(kda_ops, "_fla_usable", lambda q: True)
    x = make_inputs(20, seed=6)
    o, s = kda(**x, output_final_state=True, chunk_size=16)
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True)
    assert max_diff(o, o_ref) <= PARITY and max_diff(s, s_ref) <= PARITY
    kda(**{n: t[:, :1] if n != "initial_state" else t for n, t in x.items()})
    kda(**{n: t[:, :1].requires_grad_() if n != "initial_state" else t for n, t in x.items()})
    assert [name for name, _ in seen] == ["chunk", "fused", "chunk"]
    chunk_flags = seen[0][1]
    assert chunk_flags["chunk_size"] == 64  # fla takes 32 or 64 only
    assert not chunk_flags["use_qk_l2norm_in_kernel"] and not chunk_flags["use_gate_in_kernel"]
    assert not chunk_flags["use_beta_sigmoid_in_kernel"] and not seen[1][1]["use_qk_l2norm_in_kernel"]


def test_chunk_kda_after_inference_mode_still_differentiable():
    """Cached index tensors first built under ``torch.inference_mode`` (generation) must serve autograd too."""
    q, k, v, g, beta = (t.requires_grad_() for t in _inputs_for_cache_test())
    kda_ops._build_score_index.cache_clear()
    with torch.inference_mode():
        chunk_kda(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), chunk_size=8)
    out, _ = chunk_kda(q, k, v, g, beta, chunk_size=8)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _inputs_for_cache_test():
    generator = torch.Generator().manual_seed(7)
    q = torch.nn.functional.normalize(torch.randn(1, 11, 2, 8, generator=generator), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, 11, 2, 8, generator=generator), dim=-1)
    v = torch.randn(1, 11, 2, 8, generator=generator)
    g = -torch.nn.functional.softplus(torch.randn(1, 11, 2, 8, generator=generator))
    beta = torch.sigmoid(torch.randn(1, 11, 2, generator=generator))
    return q, k, v, g, beta
