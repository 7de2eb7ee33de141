"""The hand-written chunked KDA backward (``k2lab.ops.kda_backward``, ``chunk_kda(backward="manual")``, the
default) against autograd through the chunk form (``backward="autograd"``), against autograd through
flash-linear-attention's naive recurrent reference, and by finite differences in fp64."""

from __future__ import annotations

import pytest
import torch

from k2lab.nn.kda import RESET_LOG_DECAY
from k2lab.ops import kda as kda_ops
from k2lab.ops.kda import chunk_kda
from tests.fla_naive import load_naive
from tests.ops.test_kda import make_inputs, max_diff

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def grads(fn, x, weights, final: bool = True, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Outputs and gradients of Σ w_o ⊙ o (+ Σ w_s ⊙ final state) with respect to every input."""
    leaves = {name: t.clone().requires_grad_() for name, t in x.items() if t is not None}
    o, s = fn(**{**x, **leaves}, output_final_state=final, **kwargs)
    loss = (o * weights[0]).sum() if weights[0] is not None else 0
    if final:
        loss = loss + (s * weights[1]).sum()
    loss.backward()
    return o, {name: t.grad for name, t in leaves.items()}


def loss_weights(x, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    B, T, HV, V = x["v"].shape
    K = x["k"].shape[-1]
    return torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)


def assert_close_grads(got, want, tol: float) -> None:
    assert got.keys() == want.keys()
    for name in got:
        assert torch.isfinite(got[name]).all(), name
        assert max_diff(got[name], want[name]) <= tol, (name, max_diff(got[name], want[name]))


CASES = [  # T, chunk_size, gate kind, initial state, (H, HV)
    (37, 16, "softplus", True, (2, 4)),
    (70, 32, "strong", True, (2, 4)),
    (64, 64, "lower_bound", False, (2, 2)),
    (130, 64, "softplus", True, (1, 2)),
    (5, 64, "lower_bound", True, (2, 4)),
    (1, 16, "softplus", False, (2, 2)),
]


@pytest.mark.parametrize(("T", "chunk_size", "kind", "state", "heads"), CASES)
def test_manual_backward_matches_autograd_of_chunk_form(T, chunk_size, kind, state, heads):
    x = make_inputs(T, H=heads[0], HV=heads[1], K=16, V=24, kind=kind, seed=T, state=state)
    weights = loss_weights(x)
    o, got = grads(chunk_kda, x, weights, chunk_size=chunk_size, backward="manual")
    o_ref, want = grads(chunk_kda, x, weights, chunk_size=chunk_size, backward="autograd")
    assert torch.equal(o, o_ref)
    assert_close_grads(got, want, 1e-5)


@pytest.mark.parametrize(("T", "chunk_size", "kind", "state", "heads"), CASES[:4])
def test_manual_backward_matches_fla_naive_recurrent(T, chunk_size, kind, state, heads):
    naive = load_naive("kda")
    x = make_inputs(T, H=heads[0], HV=heads[1], K=16, V=24, kind=kind, seed=2 * T, state=state)
    weights = loss_weights(x, seed=3)
    _, got = grads(chunk_kda, x, weights, chunk_size=chunk_size)
    _, want = grads(naive.naive_recurrent_kda, x, weights)
    assert_close_grads(got, want, 1e-4)


def test_document_resets_match_autograd():
    """Packed documents: the layer sets g = RESET_LOG_DECAY (−60) at each document's first token, inside
    chunks and at chunk starts (decays held at the floor)."""
    x = make_inputs(90, K=16, V=24, seed=9)
    x["g"][:, [0, 17, 32, 33, 71]] = RESET_LOG_DECAY
    weights = loss_weights(x)
    _, got = grads(chunk_kda, x, weights, chunk_size=32)
    _, want = grads(chunk_kda, x, weights, chunk_size=32, backward="autograd")
    assert_close_grads(got, want, 1e-5)


@pytest.mark.parametrize("use", ["output", "state"])
def test_only_one_result_used(use):
    """Only o (no final state requested) or only the final state reaches the loss: the other gradient is None."""
    x = make_inputs(40, K=16, V=24, seed=4)
    w_o, w_s = loss_weights(x)
    weights = (w_o, None) if use == "output" else (None, w_s)
    final = use == "state"
    _, got = grads(chunk_kda, x, weights, final=final, chunk_size=16)
    _, want = grads(chunk_kda, x, weights, final=final, chunk_size=16, backward="autograd")
    assert_close_grads(got, want, 1e-5)


def test_bf16_autocast_backward_stays_near_fp32():
    """Under bf16 autocast (as the model runs) both backwards do their products in bf16: each stays within a
    few bf16 roundings of the fp32 gradients."""
    x = make_inputs(64, K=32, V=32, seed=5)
    weights = loss_weights(x)
    _, exact = grads(chunk_kda, x, weights, chunk_size=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, manual = grads(chunk_kda, x, weights, chunk_size=32)
        _, auto = grads(chunk_kda, x, weights, chunk_size=32, backward="autograd")
    for name in NAMES:
        scale = exact[name].abs().max().item()
        assert max_diff(manual[name], exact[name]) <= 0.05 * scale, name
        assert max_diff(manual[name], exact[name]) <= 2 * max_diff(auto[name], exact[name]) + 1e-3 * scale


def chunked_fp64_inputs(HV: int, C: int, gate, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, g = gate(N), beta, state of _ChunkKDA (chunked [1, HV, 2, C, ·], K = 3, V = 2), fp64."""
    gen = torch.Generator().manual_seed(seed)
    B, N, K, V = 1, 2, 3, 2

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = torch.nn.functional.normalize(randn(B, HV, N, C, K), dim=-1) * K**-0.5
    k = torch.nn.functional.normalize(randn(B, HV, N, C, K), dim=-1)
    v, g = randn(B, HV, N, C, V), gate(randn(B, HV, N, C, K))
    return q, k, v, g, torch.sigmoid(randn(B, HV, N, C)), randn(B, HV, K, V)


def assert_gradcheck(inputs: tuple[torch.Tensor, ...]) -> None:
    inputs = tuple(t.requires_grad_() for t in inputs)
    chunk = inputs[0].shape[-2]
    assert torch.autograd.gradcheck(
        lambda *a: kda_ops._ChunkKDA.apply(*a, chunk), inputs, eps=1e-6, atol=1e-8, rtol=1e-6
    )


def test_chunk_function_gradcheck_fp64():
    """Finite differences on the autograd.Function itself (chunked fp64 inputs: 2 chunks of 4 tokens)."""
    assert_gradcheck(chunked_fp64_inputs(2, 4, lambda x: -torch.nn.functional.softplus(x), seed=0))


def test_unknown_backward_is_refused():
    x = make_inputs(8, B=1, K=4, V=4, state=False)
    with pytest.raises(ValueError, match="backward must be"):
        chunk_kda(**x, backward="Manual")


# ------------------------------------------------------------------------------------------- tile level


def _tile_taken(monkeypatch: pytest.MonkeyPatch, force_split: bool = False) -> list[bool]:
    """Records, per call, whether the tile level ran (``force_split``: never let it)."""
    taken: list[bool] = []
    tile_factors = kda_ops._tile_factors

    def spy(g, gcum):
        factors = None if force_split else tile_factors(g, gcum)
        taken.append(factors is not None)
        return factors

    monkeypatch.setattr(kda_ops, "_tile_factors", spy)
    return taken


@pytest.mark.parametrize("resets", [False, True])
def test_tile_level_matches_the_binary_split(monkeypatch, resets):
    """K3's bounded gate, with and without packed-document resets: outputs and gradients of the tile level
    equal those of the split levels it replaces (and of fla's naive recurrence)."""
    x = make_inputs(150, K=16, V=24, kind="lower_bound", seed=11)
    if resets:
        x["g"][:, [0, 20, 21, 47, 64, 100]] = RESET_LOG_DECAY
    weights = loss_weights(x)
    taken = _tile_taken(monkeypatch)
    o, got = grads(chunk_kda, x, weights, chunk_size=64)
    assert taken == [True]
    _tile_taken(monkeypatch, force_split=True)
    o_split, want = grads(chunk_kda, x, weights, chunk_size=64)
    assert max_diff(o, o_split) <= 1e-5
    assert_close_grads(got, want, 1e-5)
    _, naive = grads(load_naive("kda").naive_recurrent_kda, x, weights)
    assert_close_grads(got, naive, 1e-4)


def test_tile_factors_only_where_the_spans_fit():
    """The tile level needs |G_t − R| ≤ TILE_EXPONENT_LIMIT: K3's gate (> −5) always fits, a gate of −6 per
    token over 8 tokens does not, a reset token (≤ −DECAY_FLOOR in every channel) inside a tile is masked
    rather than refused (at a tile's first token it needs no mask), and one channel that low alone is refused."""
    x = make_inputs(64, B=1, HV=2, K=8, V=8, kind="lower_bound", seed=12)
    g = x["g"].transpose(1, 2).contiguous()  # [B, HV, T, K]: one chunk
    factors = kda_ops._tile_factors(g, g.cumsum(-2))
    assert factors is not None and factors.same is None
    assert torch.allclose(factors.e_first * factors.e_second, torch.ones_like(factors.e_first))
    assert kda_ops._tile_factors(torch.full_like(g, -6.0), torch.full_like(g, -6.0).cumsum(-2)) is None
    reset = g.clone()
    reset[:, :, 20] = RESET_LOG_DECAY
    factors = kda_ops._tile_factors(reset, reset.cumsum(-2))
    assert factors is not None and factors.same is not None
    same = factors.same[0, 0, 1, :, 0, :]  # tile 16..31; the reset is its 5th token
    assert same[4:, 4:].all() and same[:4, :4].all() and not same[:4, 4:].any() and not same[4:, :4].any()
    reset[:, :, 20] = g[:, :, 20]
    reset[:, :, 32] = RESET_LOG_DECAY  # a tile's first token: its decay lies between tiles, no mask needed
    factors = kda_ops._tile_factors(reset, reset.cumsum(-2))
    assert factors is not None and factors.same is None
    one_channel = g.clone()
    one_channel[:, :, 20, 0] = RESET_LOG_DECAY
    assert kda_ops._tile_factors(one_channel, one_channel.cumsum(-2)) is None


def test_tile_level_gradcheck_fp64():
    """Finite differences through the tile level (2 chunks of 16 tokens, K3's gate, one reset inside a tile)."""
    q, k, v, g, beta, state = chunked_fp64_inputs(1, 16, lambda x: -5 * torch.sigmoid(x), seed=1)
    g[:, :, 1, 6] = RESET_LOG_DECAY
    assert kda_ops._tile_factors(g, g.cumsum(-2)) is not None
    assert_gradcheck((q, k, v, g, beta, state))
