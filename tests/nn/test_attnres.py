"""Block AttnRes: the mixing op against flash-linear-attention's naive reference, and the block bookkeeping
against (a) the rules written out source by source and (b) a transcription of fla's RetNet layer loop."""

import pytest
import torch
from torch import nn

from k2lab.nn.attnres import AttnRes, BlockAttnResState, attnres, attnres_reference, source_inverse_rms
from tests.fla_naive import load_naive


@pytest.fixture(scope="module")
def naive_attnres():
    return load_naive("attnres").naive_attnres


@pytest.mark.parametrize("n_sources", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fla_naive(naive_attnres, n_sources, dtype):
    torch.manual_seed(n_sources)
    D = 32
    sources = [(torch.randn(2, 5, D) * (1 + i)).to(dtype) for i in range(n_sources)]
    query, weight = torch.randn(D), 1 + 0.3 * torch.randn(D)
    got = attnres(query, sources, weight, 1e-6)
    want = naive_attnres(query, sources, weight, rms_eps=1e-6)
    assert got.dtype == dtype and got.shape == (2, 5, D)
    if dtype == torch.float32:  # logits as r·(v·(w⊙g)) rather than w·(RMSNorm(v)⊙g): a few fp32 ulps apart
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # both compute in fp32 and round once; at most one bf16 ulp apart
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-6)


def test_gradients_reach_query_key_norm_and_every_source(naive_attnres):
    torch.manual_seed(0)
    D = 16
    module = AttnRes(D)
    with torch.no_grad():
        module.query.normal_()
        module.key_norm.weight.add_(0.2 * torch.randn(D))
    sources = [torch.randn(3, D, requires_grad=True) for _ in range(4)]
    grad_out = torch.randn(3, D)
    params = [module.query, module.key_norm.weight, *sources]
    grads = torch.autograd.grad(module(sources), params, grad_out)
    ref = torch.autograd.grad(
        naive_attnres(module.query, sources, module.key_norm.weight, rms_eps=module.key_norm.eps),
        params,
        grad_out,
    )
    for got, want in zip(grads, ref, strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_backward_equals_autograd_through_the_reference(kept, dtype):
    """``attnres`` with gradients runs ``_AttnRes`` (r_i detached, their dependence on v_i written out); the
    reference is autograd through the same forward, r_i included (computed inside, or kept by the caller
    with their graph as ``BlockAttnResState`` keeps them). Both compute in fp32."""
    torch.manual_seed(1)
    D = 24
    query, weight = torch.randn(D, requires_grad=True), (1 + 0.3 * torch.randn(D)).requires_grad_()
    scales = torch.rand(5, 2, 7, 1) * 4
    sources = [(torch.randn(2, 7, D) * scales[i]).to(dtype).requires_grad_() for i in range(5)]
    grad_out = torch.randn(2, 7, D).to(dtype)
    results = []
    for fn, inputs in (
        (attnres, sources),
        (attnres_reference, [s.detach().float().requires_grad_() for s in sources]),
    ):
        # the reference on fp32 copies: autograd would round the kept r_i's gradient to bf16 on its own path
        kept_rms = [source_inverse_rms(v, 1e-6) for v in inputs] if kept else None
        out = fn(query, inputs, weight, 1e-6, kept_rms)
        results.append((out, *torch.autograd.grad(out, [query, weight, *inputs], grad_out.to(out.dtype))))
    for got, want in zip(*results, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
        else:  # ours rounds the fp32 result once to bf16: within one bf16 ulp of the fp32 reference
            torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("grad", [False, True])
def test_bf16_autocast_leaves_the_mixture_in_fp32(naive_attnres, grad):
    """Under bf16 autocast (the training step's) the logits' products v_i · (w ⊙ g) still run in fp32, as the
    module says: the same result and gradients as without autocast. Rounding the fp32 residual-stream sources
    to bf16 for those products (what autocast does to a matmul) moved the mixture by up to 0.12 here."""
    torch.manual_seed(2)
    D = 64
    query, weight = (2 * torch.randn(D)).requires_grad_(), (1 + 0.3 * torch.randn(D)).requires_grad_()
    sources = [(torch.randn(2, 9, D) * (1 + i)).requires_grad_() for i in range(4)]
    results = []
    for enabled in (False, True):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", torch.bfloat16, enabled=enabled):
            out = attnres(query, sources, weight, 1e-6)
        grads = torch.autograd.grad(out.sum(), [query, weight, *sources]) if grad else ()
        results.append((out, *grads))
    for got, want in zip(results[1], results[0], strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        results[0][0], naive_attnres(query, sources, weight, rms_eps=1e-6), rtol=1e-5, atol=1e-5
    )


def test_zero_query_is_the_mean_and_one_source_is_identity():
    module = AttnRes(8)
    assert module.query.eq(0).all() and module.key_norm.weight.eq(1).all()
    sources = [torch.randn(4, 8) * (i + 1) for i in range(3)]
    torch.testing.assert_close(module(sources), sum(sources) / 3)
    one = torch.randn(4, 8).bfloat16()
    assert torch.equal(module([one]), one)
    with torch.no_grad():
        module.query.normal_()
        module.key_norm.weight.normal_()
    module.reset_parameters()
    assert module.query.eq(0).all() and module.key_norm.weight.eq(1).all()


# ---- Block bookkeeping ----------------------------------------------------------------------------------


class ToyLayer(nn.Module):
    """Token-wise sub-layers (attention and MLP stand-ins) with their own AttnRes each."""

    def __init__(self, D: int) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(D, D), nn.Linear(D, D)
        self.attn_res, self.mlp_res = AttnRes(D), AttnRes(D)
        with torch.no_grad():
            for res in (self.attn_res, self.mlp_res):
                res.query.normal_()


def run_state(embedding, layers, final_res, block_size, log=None):
    """The decoder loop as the state's docstring writes it; ``log`` collects each AttnRes's sources."""

    def mix(res, sources):
        if log is not None:
            log.append(sources)
        return res(sources)

    state = BlockAttnResState(embedding, block_size)
    for l, layer in enumerate(layers):
        state.start_layer(l)
        state.add(torch.tanh(layer.attn(mix(layer.attn_res, state.sources()))))
        state.add(torch.tanh(layer.mlp(mix(layer.mlp_res, state.sources()))))
    return mix(final_res, state.sources())


def run_rules(embedding, layers, final_res, block_size, log):
    """The rules, written out: sources = [embedding, sums of completed blocks, sum of the current block so far]."""
    outputs: list[tuple[int, torch.Tensor]] = []  # (layer index, sub-layer output), in order

    def sources_at(layer_idx: int) -> list[torch.Tensor]:
        current = layer_idx // block_size
        blocks = []
        for b in range(current + 1):
            members = [o for l, o in outputs if l // block_size == b]
            if members:
                total = members[0]
                for o in members[1:]:
                    total = total + o
                blocks.append(total)
        return [embedding, *blocks]

    for l, layer in enumerate(layers):
        sources = sources_at(l)
        log.append(sources)
        outputs.append((l, torch.tanh(layer.attn(layer.attn_res(sources)))))
        sources = sources_at(l)
        log.append(sources)
        outputs.append((l, torch.tanh(layer.mlp(layer.mlp_res(sources)))))
    sources = sources_at(len(layers) - 1)
    log.append(sources)
    return final_res(sources)


def run_fla_retnet(embedding, layers, final_res, fla_block_size, naive):
    """fla/models/retnet/modeling_retnet.py's AttnRes loop (block size in sub-layers), transcribed."""

    def mix(res, residuals):
        return naive(res.query, residuals, res.key_norm.weight, rms_eps=res.key_norm.eps)

    states, hidden = None, embedding
    for idx, layer in enumerate(layers):
        if states is None:  # layer 0: one source, identity
            x, states, prefix = hidden, [hidden], None
        else:
            prefix = hidden
            residuals = [*states, prefix]
            if (2 * idx) % fla_block_size == 0:
                states, prefix = residuals, None
            x = mix(layer.attn_res, residuals)
        out = torch.tanh(layer.attn(x))
        prefix = out if prefix is None else prefix + out
        residuals = [*states, prefix]
        if (2 * idx + 1) % fla_block_size == 0:
            states, prefix = residuals, None
        out = torch.tanh(layer.mlp(mix(layer.mlp_res, residuals)))
        hidden = out if prefix is None else prefix + out
    return mix(final_res, [*states, hidden])


@pytest.mark.parametrize(("n_layers", "block_size"), [(7, 3), (6, 3), (5, 1), (4, 4), (3, 8)])
def test_block_bookkeeping_matches_rules_and_fla_retnet(naive_attnres, n_layers, block_size):
    torch.manual_seed(block_size * 10 + n_layers)
    D = 12
    layers = [ToyLayer(D) for _ in range(n_layers)]
    final_res = AttnRes(D)
    with torch.no_grad():
        final_res.query.normal_()
    embedding = torch.randn(2, 3, D)

    state_log, rules_log = [], []
    got = run_state(embedding, layers, final_res, block_size, state_log)
    want = run_rules(embedding, layers, final_res, block_size, rules_log)
    assert [len(s) for s in state_log] == [len(s) for s in rules_log]
    for ours, theirs in zip(state_log, rules_log, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)
    assert torch.equal(got, want)
    fla = run_fla_retnet(embedding, layers, final_res, 2 * block_size, naive_attnres)
    torch.testing.assert_close(got, fla, rtol=1e-6, atol=1e-6)

    # the shape of the history: layer 0's attention reads the embedding alone; the final AttnRes reads the
    # embedding, ⌈L/B⌉ − 1 completed blocks and the last (partial) block
    assert len(state_log[0]) == 1 and state_log[0][0] is embedding
    assert len(state_log[-1]) == 1 + (n_layers + block_size - 1) // block_size


def test_state_keeps_partial_sums_in_the_residual_dtype():
    embedding = torch.zeros(2, 4)
    state = BlockAttnResState(embedding, block_size=2)
    state.add(torch.full((2, 4), 1 / 3).bfloat16())
    state.add(torch.full((2, 4), 1e-3).bfloat16())
    assert state.partial.dtype == torch.float32
    with pytest.raises(ValueError):
        BlockAttnResState(embedding, 0)
    with pytest.raises(ValueError):
        attnres(torch.zeros(4), [], torch.ones(4))
