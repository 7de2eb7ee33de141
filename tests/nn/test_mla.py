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


@pytest.mark.parametrize("documents", [False, True])
def test_bf16_training_forward_takes_the_blocked_backward(monkeypatch, documents):
    """Under bf16 autocast with gradients MLA's attention runs ``ops.attention``'s blocked backward; against
    the layer in fp32 its output and every gradient are as close as with SDPA's backward (``MAX_BLOCKED_KEYS``
    0), with a plain causal mask and with packed documents."""
    from k2lab.ops import attention as attention_module

    torch.manual_seed(0)
    config = load_preset("k2-nano")
    attn = MultiHeadLatentAttention(config)
    B, T = 2, 40
    x = torch.randn(B, T, config.hidden_size)
    cos, sin = torch.ones(B, T, config.qk_rope_head_dim // 2), torch.zeros(B, T, config.qk_rope_head_dim // 2)
    allowed = None
    if documents:
        segment = (torch.arange(T) >= 17).long().expand(B, T)
        same = segment[:, :, None] == segment[:, None, :]
        allowed = (same & torch.ones(T, T, dtype=torch.bool).tril())[:, None]
    calls = []
    blocked = attention_module.blocked_attention
    monkeypatch.setattr(attention_module, "blocked_attention", lambda *a: calls.append(1) or blocked(*a))

    def run(low_precision: bool, limit: int) -> list[torch.Tensor]:
        monkeypatch.setattr(attention_module, "MAX_BLOCKED_KEYS", limit)
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low_precision):
            out = attn(inputs, cos, sin, AttentionMask(allowed)).float()
        return [out.detach(), *torch.autograd.grad(out.square().sum(), [inputs, *attn.parameters()])]

    limit = attention_module.MAX_BLOCKED_KEYS
    reference = run(False, 0)
    ours, sdpa = run(True, limit), run(True, 0)
    assert len(calls) == 1
    for a, b, want in zip(ours, sdpa, reference, strict=True):
        error, kernel_error = (float((t - want).norm() / want.norm()) for t in (a, b))
        assert error <= 1.5 * kernel_error + 1e-3, (error, kernel_error)
