import pytest
import torch

from k2lab import load_preset
from k2lab.nn.mla import AttentionMask, MultiHeadLatentAttention, max_logits_paused, reduced_latent_attention
from tests.conftest import nano_variant


@pytest.mark.parametrize("queries", [1, 3])
def test_reduced_latent_attention_equals_the_eager_absorbed_form(queries):
    """The compiled decode tier (products and sums) against SDPA between two bmm, with left padding."""
    torch.manual_seed(0)
    config = load_preset("k2-nano")
    attn = MultiHeadLatentAttention(config)
    B, S, H = 3, 11, config.num_attention_heads
    q_nope = torch.randn(B, queries, H, config.qk_nope_head_dim)
    q_rope = torch.randn(B, queries, H, config.qk_rope_head_dim)
    keys = torch.randn(B, S, config.kv_lora_rank + config.qk_rope_head_dim)
    allowed = torch.ones(queries, S, dtype=torch.bool).tril(S - queries).expand(B, 1, queries, S).clone()
    allowed[1, :, :, :4] = False  # row 1 is left-padded by 4
    with torch.no_grad():
        eager = attn._absorbed_attention(q_nope, q_rope, keys, AttentionMask(allowed))
        w_uk, w_uv = attn.up_weights()
        reduced = reduced_latent_attention(q_nope, q_rope, keys, allowed, w_uk, w_uv, attn.softmax_scale)
    assert reduced.shape == (B, queries, H, config.v_head_dim)
    torch.testing.assert_close(reduced, eager, atol=1e-5, rtol=1e-5)


def test_max_logits_paused_restores_each_layer_setting_even_on_error():
    model = nano_variant()
    layers = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    layers[0].record_max_logits = True  # the others off
    with pytest.raises(RuntimeError), max_logits_paused(model):
        assert not any(layer.record_max_logits for layer in layers)
        model(torch.randint(0, 128, (1, 6)))
        raise RuntimeError
    assert layers[0].max_logits is None
    assert [layer.record_max_logits for layer in layers] == [True] + [False] * (len(layers) - 1)
