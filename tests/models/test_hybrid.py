"""The hybrid decoder (Kimi Linear / K3): KDA + NoPE/gated MLA layers, both cache kinds, document masking."""

from __future__ import annotations

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.infer import GenerationConfig, LatentCache, generate
from k2lab.nn.kda_gate import lower_bounded_decay, softplus_decay
from tests.conftest import KIMI_LINEAR_STYLE, randomize


def hybrid(**overrides: object):
    return randomize(build_model(load_preset("k3-nano", **overrides)))


@pytest.fixture(params=["k3", "kimi-linear"])
def model(request):
    return hybrid() if request.param == "k3" else hybrid(**KIMI_LINEAR_STYLE)


def test_layer_pattern_and_modules():
    config = load_preset("k3")
    assert config.layer_types.count("kda") == 69 and config.layer_types.count("mla") == 24
    assert (
        config.layer_types[3] == "mla"
        and config.layer_types[92] == "mla"
        and config.layer_types[91] == "mla"
        and config.layer_types[90] == "kda"
    )
    model = hybrid()
    assert [layer.kind for layer in model.layers] == ["kda", "mla", "kda", "mla"]
    assert model.rotary is None  # NoPE everywhere: no rotary tables at all


def test_cached_decode_equals_full_forward(model):
    """Equal within fp32 rounding: the chunked and the recurrent KDA sum in different orders. Each fp32 path
    is itself up to 3e-4 from an fp64 forward of the same model (logits up to ≈ 5; over 240 seeds the two
    paths differed by up to 3.1e-4, and atol 1e-4 failed 2 of them), so the bound is 1e-3; a wrong cache
    shifts logits by O(1)."""
    ids = torch.randint(3, 128, (2, 21))
    full = model(ids).logits
    cache = LatentCache(model.config, batch_size=2, max_length=32)
    pieces = [model(ids[:, :9], cache=cache).logits]
    for t in range(9, 21):
        pieces.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-3, rtol=1e-4)


def test_a_one_tap_short_conv_caches_and_decodes():
    """linear_conv_kernel_dim = 1 (valid: gt 0) keeps no history; a cached prefill of more than one token
    crashed copying the whole window into the empty conv state."""
    test_cached_decode_equals_full_forward(hybrid(linear_conv_kernel_dim=1))


def test_left_padded_batch_equals_each_alone(model):
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [99]]
    config = GenerationConfig(max_new_tokens=8)
    batched = generate(model, prompts, config)
    assert batched == [generate(model, [p], config)[0] for p in prompts]


PAD_PATTERNS = {"left": [0, 0, 1, 1, 1], "right": [1, 1, 1, 0, 0], "holes": [1, 0, 1, 0, 1]}


@pytest.mark.parametrize("pattern", PAD_PATTERNS)
@pytest.mark.parametrize("cached", [3, 0], ids=["after-cache", "from-empty"])
@pytest.mark.parametrize("layers", ["hybrid", "kda-only"])
def test_padded_chunk_equals_its_real_tokens_alone(pattern, cached, layers):
    """Pads anywhere in a chunk leave every KDA state as if they were absent: the logits of the real
    tokens, the states after the chunk and the next step's logits equal those of the unpadded chunk. A pad
    used to decay the recurrent state (g from dt_bias) and shift the short convolution's history (0.6 in the
    logits after a cached prefix, left padding)."""
    model = hybrid() if layers == "hybrid" else hybrid(mla_layers=[])
    ids = torch.randint(3, 128, (2, cached + 4))
    valid = torch.tensor([PAD_PATTERNS[pattern]] * 2, dtype=torch.bool)
    padded_ids = torch.zeros(2, 5, dtype=torch.long).masked_scatter(valid, ids[:, cached : cached + 3])
    runs = []
    for chunk, mask in ((ids[:, cached : cached + 3], None), (padded_ids, valid)):
        cache = LatentCache(model.config, batch_size=2, max_length=16)
        if cached:
            model(ids[:, :cached], cache=cache)
        logits = model(chunk, attention_mask=mask, cache=cache).logits
        logits = logits if mask is None else logits[mask].view(2, 3, -1)
        states = [t for s in cache.kda_states.values() for t in (s.conv, s.recurrent)]
        runs.append((logits, states, model(ids[:, -1:], cache=cache).logits))
    torch.testing.assert_close(runs[1], runs[0], atol=1e-4, rtol=1e-4)


def test_kda_decode_memory_is_constant_in_context():
    config = load_preset("k3-nano")
    short, long = (LatentCache(config, 1, length) for length in (16, 4096))
    assert short.state_bytes == long.state_bytes > 0
    kda_layers = config.layer_types.count("kda")
    H, K = config.linear_num_heads, config.linear_head_dim
    conv = 3 * H * K * (config.linear_conv_kernel_dim - 1)
    assert short.state_bytes == kda_layers * 4 * (H * K * K + conv)
    assert short.bytes_per_token == 2 * 4 * (config.kv_lora_rank + config.qk_rope_head_dim)


@pytest.mark.parametrize("preset", ["k2-nano", "k3-nano"])
def test_document_masking_equals_documents_alone(preset):
    model = randomize(build_model(load_preset(preset)))
    torch.manual_seed(0)
    lengths = [5, 1, 11, 7]
    docs = [torch.randint(3, 128, (1, n)) for n in lengths]
    packed = torch.cat(docs, 1)
    segments = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], 1)
    logits = model(packed, segment_ids=segments).logits
    alone = torch.cat([model(doc).logits for doc in docs], 1)
    # fp32 rounding only: the chunked KDA sums the packed window in another order than each document alone
    assert torch.allclose(logits, alone, atol=3e-4, rtol=1e-4)
    leaky = model(packed).logits  # without the mask, later documents see earlier ones
    assert not torch.allclose(leaky[:, lengths[0] :], alone[:, lengths[0] :], atol=1e-3)


def test_lower_bounded_gate_keeps_every_tile_in_bf16_range():
    generator = torch.Generator().manual_seed(0)
    f = 30 * torch.randn(4, 256, 3, 8, generator=generator)  # far beyond any trained pre-activation
    a_log = torch.tensor([-2.0, 0.0, 2.7])  # A = exp(A_log) from 0.14 to 15
    for g in (lower_bounded_decay(f, a_log, -5.0), lower_bounded_decay(-f.abs(), a_log, -5.0)):
        tiles = g.view(4, 16, 16, 3, 8).sum(2)  # accumulated log-decay of every 16-token tile
        assert tiles.max() <= 0 and tiles.min() > -80
    unbounded = softplus_decay(f, a_log).view(4, 16, 16, 3, 8).sum(2)
    assert unbounded.min() < -80  # the Kimi Linear gate has no such bound


def test_gated_mla_halves_output_at_zero_gate():
    model = hybrid()
    attn = model.layers[1].attn
    x = torch.randn(1, 6, model.config.hidden_size)
    from k2lab.nn.mla import AttentionMask

    with torch.no_grad():
        attn.gate_proj.weight.zero_()
        gated = attn(x, None, None, AttentionMask(None))
        del attn.gate_proj
        plain = attn(x, None, None, AttentionMask(None))
    assert torch.allclose(gated, 0.5 * plain, atol=1e-6)


def test_hybrid_trains(model):
    model.train()
    ids = torch.randint(3, 128, (2, 40))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("preset", ["k2-mini", "k3-mini"])
def test_meta_cache_bytes_equal_allocated(preset):
    """The decode-cache curve of the full presets is read off meta-device caches: check that reading."""
    config = load_preset(preset)
    meta = LatentCache(config, 1, 300, dtype=torch.bfloat16, device="meta").nbytes()
    real = LatentCache(config, 1, 300, dtype=torch.bfloat16)
    tensors = [real.rows, *(t for s in real.kda_states.values() for t in (s.conv, s.recurrent))]
    assert meta == sum(t.untyped_storage().nbytes() for t in tensors)
    assert meta == real.bytes_per_sequence(300)


def test_decode_steps_run_every_product_through_decode_linear(model):
    """A cached decode step of a hybrid model calls no ``nn.Linear`` forward: KDA's projections, its forget
    gate's and the latent MoE's run through ``decode_linear`` like MLA's, so the compiled step takes the
    reduction tier for them over fp32 weights too (a bf16 twin swaps the ``nn.Linear`` classes instead)."""
    model.eval()
    called = []
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.register_forward_hook(lambda module, args, out: called.append(module))
    with torch.inference_mode():
        cache = LatentCache(model.config, batch_size=2, max_length=8)
        model(torch.randint(3, 128, (2, 5)), cache=cache)
        model(torch.randint(3, 128, (2, 1)), cache=cache)
    assert called == []
